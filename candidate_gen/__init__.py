"""Candidate generation: RecBole atomic data, SASRec retriever, FAISS index, candidate lists."""
