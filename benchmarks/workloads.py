"""Prompts for the benchmarks, built from ../shared/data (read-only) with the model's tokenizer.

  short         AIME25 problems and GSM8K questions with the chat template (short input, long
                output)
  long          a 16K-32K-token passage of Frankenstein plus a question about it, with the chat
                template (long input, an answer that ends at EOS)
  continuation  a 16K-32K-token passage of Frankenstein as plain text: no chat template, no
                question, the model continues the book (the long-input workload MagicDec and
                TriForce run on PG-19)

Passage lengths are checked before anything is built: a book too short for the asked length, or
min > max, is a one-line ValueError.
"""
from __future__ import annotations

import bisect
import functools
import json
import random

from jaxspec.io.data import data_path

BOOK = "frankenstein.txt"
LONG_QUESTIONS = (
    "Summarise what happens in the passage above, chapter by chapter.",
    "Which characters appear in the passage above, and how do they relate to each other?",
    "Describe the narrator's state of mind over the course of the passage above.",
    "List the places mentioned in the passage above in the order they appear.",
)
LONG_ROOM = 64   # tokens kept free in a long prompt for the chat template and the question
WORKLOADS = ["short", "long", "continuation"]


def _jsonl(name: str, field: str) -> list[str]:
  with open(data_path(name)) as f:
    return [json.loads(line)[field] for line in f if line.strip()]


def short_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
  """n chat prompts alternating AIME25 problems and GSM8K questions (cycled, shuffled)."""
  from jaxspec.io.loading import apply_chat_template
  aime, gsm = _jsonl("aime25.jsonl", "problem"), _jsonl("gsm8k_test.jsonl", "question")
  rng = random.Random(seed)
  rng.shuffle(gsm)
  texts = [(aime[i // 2 % len(aime)] if i % 2 == 0 else gsm[i // 2 % len(gsm)]) for i in range(n)]
  suffix = "\nPlease reason step by step, and put your final answer within \\boxed{}."
  return [tokenizer.encode(apply_chat_template(tokenizer, t + suffix), add_special_tokens=False)
          for t in texts]


def _read_text(name: str) -> str:
  # utf-8-sig: the Gutenberg file opens with a byte-order mark, which is not book text.
  with open(data_path(name), encoding="utf-8-sig") as f:
    return f.read()


def check_prompt_range(min_tokens: int, max_tokens: int, room: int = 0) -> None:
  """One-line ValueError unless room < min_tokens <= max_tokens (`room`: what a prompt holds
  besides the passage, so that every passage has at least one token)."""
  if min_tokens <= room or min_tokens > max_tokens:
    raise ValueError(f"prompt lengths must satisfy {room} < min <= max tokens, got min "
                     f"{min_tokens} and max {max_tokens} "
                     "(--prompt_min_tokens, --prompt_max_tokens)")


def check_passage_lengths(source: str, source_tokens: int, min_tokens: int, max_tokens: int,
                          room: int = 0) -> None:
  """`check_prompt_range`, and a one-line ValueError unless a passage of max_tokens - room tokens
  fits the `source_tokens`-token source as a strict sub-span (at least one token left out)."""
  check_prompt_range(min_tokens, max_tokens, room)
  if max_tokens - room >= source_tokens:
    raise ValueError(f"{source} holds {source_tokens} tokens with this tokenizer: no room for a "
                     f"passage of up to {max_tokens - room} tokens (lower --prompt_max_tokens)")


def _book_tokens(tokenizer, name: str) -> list[int]:
  return tokenizer.encode(_read_text(name), add_special_tokens=False)


def long_prompts(tokenizer, n: int, min_tokens: int = 16384, max_tokens: int = 32768,
                 seed: int = 0, book: str = BOOK) -> list[list[int]]:
  """n chat prompts: a random passage of `book` plus a question, about min..max tokens in all (the
  passage is decoded and re-encoded inside the chat template, so lengths move by a few tokens)."""
  from jaxspec.io.loading import apply_chat_template
  ids = _book_tokens(tokenizer, book)
  check_passage_lengths(book, len(ids), min_tokens, max_tokens, room=LONG_ROOM)
  rng = random.Random(seed)
  prompts = []
  for i in range(n):
    length = rng.randint(min_tokens, max_tokens) - LONG_ROOM
    start = rng.randrange(0, len(ids) - length)
    passage = tokenizer.decode(ids[start:start + length])
    question = LONG_QUESTIONS[i % len(LONG_QUESTIONS)]
    prompts.append(tokenizer.encode(apply_chat_template(tokenizer, f"{passage}\n\n{question}"),
                                    add_special_tokens=False))
  return prompts


def paragraph_starts(pieces: list[str]) -> list[int]:
  """Indices of the tokens that open a paragraph: those right after a token whose text ends with
  a blank line. `pieces`: each token's text, in order."""
  return [i + 1 for i, p in enumerate(pieces[:-1]) if p.endswith("\n\n")]


def continuation_prompts(tokenizer, n: int, min_tokens: int = 16384, max_tokens: int = 32768,
                         seed: int = 0, book: str = BOOK) -> list[list[int]]:
  """n plain-text prompts of min..max tokens each (exactly): a passage of `book` opening at a
  paragraph, with no chat template and no question, for the model to continue.

  A prompt is the tokenizer's own special prefix for plain text (a BOS where the model uses one,
  as `jaxspec.generate` encodes plain prompts) followed by the book's tokens, sliced from one
  encoding of the whole book, so the length is exact and nothing is re-tokenized."""
  prefix = tokenizer.encode("", add_special_tokens=True)
  ids = _book_tokens(tokenizer, book)
  check_passage_lengths(book, len(ids), min_tokens, max_tokens, room=len(prefix))
  decode_one = functools.lru_cache(maxsize=None)(lambda t: tokenizer.decode([t]))
  starts = paragraph_starts([decode_one(t) for t in ids]) or list(range(len(ids)))
  rng = random.Random(seed)
  prompts = []
  for _ in range(n):
    length = rng.randint(min_tokens, max_tokens) - len(prefix)
    last = bisect.bisect_right(starts, len(ids) - length)   # starts whose passage fits the book
    start = starts[rng.randrange(last)] if last else rng.randrange(len(ids) - length + 1)
    prompts.append(prefix + ids[start:start + length])
  return prompts


PASSAGE_MAX = 32768   # the longest passage by default: 32K, or what the model's context leaves


def prompt_max_tokens(requested: int | None, context: int, max_new: int) -> int:
  """The longest prompt of a long-input workload: `requested`, or by default PASSAGE_MAX capped so
  that prompt + max_new fits the model's context. One-line ValueError when a requested length
  does not fit (a 32K passage plus 1024 new tokens does not fit Qwen2.5-Coder's 32768)."""
  room = context - max_new
  if requested is None:
    return min(PASSAGE_MAX, room)
  if requested > room:
    raise ValueError(f"--prompt_max_tokens {requested} plus {max_new} new tokens exceed the "
                     f"model's context of {context} tokens (at most {room})")
  return requested


def build(workload: str, tokenizer, n: int, min_tokens: int = 16384, max_tokens: int = 32768,
          seed: int = 0) -> list[list[int]]:
  """The n prompts of `workload` (one of WORKLOADS); min/max_tokens: long and continuation."""
  if workload == "short":
    return short_prompts(tokenizer, n, seed)
  if workload == "long":
    return long_prompts(tokenizer, n, min_tokens, max_tokens, seed)
  if workload == "continuation":
    return continuation_prompts(tokenizer, n, min_tokens, max_tokens, seed)
  raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
