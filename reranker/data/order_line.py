"""Add the retriever-order line to prompts rendered without it: the data side of the A/B that made
it part of the cpu prompt profile (scripts/ab-order-line.sh; docs/EXPERIMENTS.md, "A retriever-order
line"). Both arms are written the same way, so they differ only in that line:

    python -m reranker.data.order_line --add --data RUN/rerank_data --out DIR \\
        --file copies/DRAW.jsonl:train.jsonl --file valid.jsonl:valid.jsonl
"""
from __future__ import annotations

import argparse
from pathlib import Path

from candidate_gen.files import iter_jsonl, write_jsonl

from reranker.data.retrace import copy_support_files
from reranker.text.prompt import CANDIDATES_HEADERS, ORDER_LINE_PREFIXES, prompt_candidate_sids, render_order_line


def add_order_line(record: dict) -> dict:
    """`record` with "Retriever order: [...]" before its prompt's last line ("Rank all N candidates."),
    listing the SIDs of its numbered candidate lines in order, as render_prompt_messages writes it."""
    messages = [dict(m) for m in record["prompt_messages"]]
    body = messages[-1]["content"].rstrip("\n")
    if CANDIDATES_HEADERS["scorer"] in body:
        raise ValueError("the prompt lists its candidates in scorer order, which has its own order line")
    if "\n" + ORDER_LINE_PREFIXES["retriever"] in body:
        raise ValueError("the prompt already has a retriever-order line")
    sids = prompt_candidate_sids(body)
    if not sids or "\n" not in body:
        raise ValueError("the prompt has no numbered candidate lines")
    head, last = body.rsplit("\n", 1)
    messages[-1]["content"] = f"{head}\n{render_order_line(sids)}\n{last}"
    return {**record, "prompt_messages": messages}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m reranker.data.order_line", description=__doc__.split("\n\n")[0])
    arm = ap.add_mutually_exclusive_group(required=True)
    arm.add_argument("--add", action="store_true", help="add the line to every prompt")
    arm.add_argument("--keep", action="store_true", help="copy the prompts unchanged (the other arm)")
    ap.add_argument("--data", required=True, type=Path, help="the data directory the files come from")
    ap.add_argument("--out", required=True, type=Path, help="the data directory to write")
    ap.add_argument("--file", action="append", required=True, metavar="SRC:DST",
                    help="a JSONL file of --data (relative) and its name in --out; repeatable")
    args = ap.parse_args(argv)
    if args.out.resolve() == args.data.resolve():
        ap.error("--out must differ from --data")
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in args.file:
        src, sep, dst = spec.partition(":")
        if not sep or not src or not dst:
            ap.error(f"--file {spec!r}: expected SRC:DST")
        rows = []
        for n, row in iter_jsonl(args.data / src):
            try:
                rows.append(add_order_line(row) if args.add else row)
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"{args.data / src}:{n}: {e}") from None
        write_jsonl(args.out / dst, rows)
        print(f"{args.out / dst}: {len(rows)} records")
    copy_support_files(args.data, args.out)


if __name__ == "__main__":
    main()
