"""The text protocol between the retriever's lists and the LM: semantic IDs, the tokenizer, prompts and the parsed answer."""
