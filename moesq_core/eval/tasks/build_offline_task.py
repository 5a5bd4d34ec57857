"""Build the shipped offline lm-eval task `moesq_cloze` from the shared evaluation text.

Each example is a sentence from a prose paragraph of the held-out documents (`shared/data/eval-docs.txt.xz`),
preceded by the sentences before it in its paragraph. One word of the sentence is a blank with four options:
the true word and three words taken from neighbouring paragraphs of the same document (same topic, so the
topic alone does not give the answer). The model scores the four complete sentences after the context
(lm-eval `multiple_choice`, log-likelihood, no generation); chance is 25 %. The four candidates differ in one
word only, so the task tracks how well the model knows syntax and usage in context, which is what
compression damages: on the micro model, paired 4:8 magnitude pruning + NVFP4 costs ~9 points.

Why not "pick the next sentence among sentences from other documents": we tried it; scores were dominated by
how likely each candidate sentence is on its own, and a badly pruned model scored *higher* than the
reference. Choices that differ in one word cancel that prior.

The construction is deterministic (seeded); rerunning reproduces the committed JSONL byte for byte:

    python moesq_core/eval/tasks/build_offline_task.py            # rewrites moesq_cloze.jsonl
    python moesq_core/eval/tasks/build_offline_task.py --check    # exit 1 if the committed file differs
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_SOURCE = HERE.parents[2].parent / "shared" / "data" / "eval-docs.txt.xz"
DEFAULT_OUT = HERE / "moesq_cloze.jsonl"

SEED = 20260107
NUM_EXAMPLES = 400
NUM_CHOICES = 4
NEIGHBOURHOOD = 8  # distractor words come from paragraphs at most this many blocks away (same document)
MIN_SENT, MAX_SENT = 40, 220  # characters of a question sentence
MIN_CONTEXT, MAX_CONTEXT = 60, 400  # characters of context (its end, cut at a sentence boundary)

# A sentence ends at . ! or ? followed by whitespace and a capital letter (or RST markup opening a new
# sentence). Abbreviations such as "e.g." are usually followed by lower case here, so they rarely split.
_SENT_END = re.compile(r"(?<=[a-z0-9)\]'\"`*][.!?])\s+(?=[A-Z(`*\"'])")
_ABBREV = re.compile(r"\b(e\.g|i\.e|etc|vs|cf|Fig|No|Mr|Dr|approx)\.$")
_UNDERLINE = re.compile(r"^\s*([=\-~^*#\"+`'])\1{2,}\s*$")
# Blanks and options: plain lower-case words of 4+ letters (no identifiers, markup or numbers).
_WORD = re.compile(r"(?<![\w`*:./-])[a-z]{4,}(?![\w`*:/-])")


@dataclass(frozen=True)
class Paragraph:
    block: int  # index of the blank-line separated block in the source
    sentences: tuple[str, ...]


def read_blocks(source: Path) -> list[str]:
    with lzma.open(source, "rt", encoding="utf-8") as fh:
        text = fh.read()
    return [b for b in re.split(r"\n[ \t]*\n", text) if b.strip()]


def strip_headings(block: str) -> str:
    """Drop reStructuredText section titles (a line underlined, maybe overlined, by punctuation)."""
    out: list[str] = []
    for line in block.split("\n"):
        if _UNDERLINE.match(line):
            if out and not _UNDERLINE.match(out[-1]):
                out.pop()  # the title above the underline
            continue
        out.append(line)
    return "\n".join(out)


def is_prose(text: str) -> bool:
    """Running English text, not code, tables, headings or directives."""
    if len(text) < 120 or text.startswith(("..", ":", "|", ">>>", "$", "#", "+", "=", "-", "*", "[")):
        return False
    letters = sum(c.isalpha() or c == " " for c in text)
    return letters / len(text) >= 0.85 and text[-1] in ".!?:)"


def split_sentences(text: str) -> list[str]:
    out: list[str] = []
    for part in _SENT_END.split(text):
        if out and _ABBREV.search(out[-1]):  # re-join a split made after an abbreviation
            out[-1] = out[-1] + " " + part
        else:
            out.append(part)
    return out


def prose_paragraphs(blocks: list[str]) -> list[Paragraph]:
    paras = []
    for i, b in enumerate(blocks):
        # Collapse line wrapping: the source's wrap column is noise the model should not have to model.
        text = " ".join(strip_headings(b).split())
        if is_prose(text):
            paras.append(Paragraph(i, tuple(split_sentences(text))))
    return paras


def _ok_sentence(s: str) -> bool:
    return MIN_SENT <= len(s) <= MAX_SENT and s[-1] in ".!?"


def _clip_context(sentences: tuple[str, ...]) -> str | None:
    """The last whole sentences that fit in MAX_CONTEXT characters (the end matters most)."""
    kept: list[str] = []
    for s in reversed(sentences):
        if sum(len(k) + 1 for k in kept) + len(s) > MAX_CONTEXT:
            break
        kept.insert(0, s)
    text = " ".join(kept)
    return text if len(text) >= MIN_CONTEXT else None


def _related(a: str, b: str) -> bool:
    """Inflections of one another (page/pages, decide/decided): too close to count as a wrong option."""
    n = min(len(a), len(b), 5)
    return a[:n] == b[:n]


def cloze_examples(source: Path, seed: int = SEED, n: int = NUM_EXAMPLES) -> list[dict]:
    """The task's `n` examples from the text at `source`, drawn with `seed` (what moesq_cloze.jsonl holds)."""
    paras = prose_paragraphs(read_blocks(source))
    words_of = {p.block: {w for s in p.sentences for w in _WORD.findall(s)} for p in paras}
    blocks = sorted(words_of)

    # Questions: a sentence (not the first) of a paragraph, with the text before it as context.
    candidates = [(p, j) for p in paras for j in range(1, len(p.sentences)) if _ok_sentence(p.sentences[j])]
    rng = random.Random(seed)
    rng.shuffle(candidates)

    examples, used_paragraphs = [], set()
    for p, j in candidates:
        if len(examples) == n:
            break
        if p.block in used_paragraphs:  # one question per paragraph: more variety, less redundancy
            continue
        context = _clip_context(p.sentences[:j])
        sentence = p.sentences[j]
        blanks = list(_WORD.finditer(sentence))
        if context is None or not blanks:
            continue
        blank = rng.choice(blanks)
        answer = blank.group()
        in_sentence = set(_WORD.findall(sentence))
        pool = sorted(
            {w for b in blocks if 0 < abs(b - p.block) <= NEIGHBOURHOOD for w in words_of[b]}
            - in_sentence
        )
        pool = [w for w in pool if not _related(w, answer)]
        if len(pool) < NUM_CHOICES - 1:
            continue
        options = rng.sample(pool, NUM_CHOICES - 1) + [answer]
        rng.shuffle(options)
        used_paragraphs.add(p.block)
        examples.append({
            "id": len(examples),
            "context": context,
            "before": sentence[: blank.start()],
            "after": sentence[blank.end():],
            "options": options,
            "label": options.index(answer),
            "source_block": p.block,
        })
    if len(examples) < n:
        raise RuntimeError(f"only {len(examples)} examples could be built from {source}, wanted {n}")
    return examples


def dumps(examples: list[dict]) -> str:
    return "".join(json.dumps(e, ensure_ascii=False, sort_keys=True) + "\n" for e in examples)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="eval-docs.txt.xz (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("-n", type=int, default=NUM_EXAMPLES)
    ap.add_argument("--check", action="store_true", help="only compare a fresh build with the existing --out file")
    args = ap.parse_args(argv)
    if not args.source.is_file():
        ap.error(f"source text {args.source} not found; pass --source path/to/eval-docs.txt.xz")
    text = dumps(cloze_examples(args.source.resolve(), args.seed, args.n))
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    if args.check:
        same = args.out.is_file() and args.out.read_text(encoding="utf-8") == text
        print(f"{args.out}: {'up to date' if same else 'DIFFERS from a fresh build'} (fresh sha256 {digest})")
        return 0 if same else 1
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {args.n} examples, {len(text.encode())} bytes, sha256 {digest} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
