"""Prompts for the benchmarks, built from ../shared/data (read-only) with the model's tokenizer.

  short  AIME25 problems and GSM8K questions with the chat template (short input, long output)
  long   a 16K-32K-token passage of Frankenstein plus a question about it (long input)
"""
from __future__ import annotations

import json
import os
import random

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
LONG_QUESTIONS = (
    "Summarise what happens in the passage above, chapter by chapter.",
    "Which characters appear in the passage above, and how do they relate to each other?",
    "Describe the narrator's state of mind over the course of the passage above.",
    "List the places mentioned in the passage above in the order they appear.",
)


def data_path(name: str) -> str:
  path = os.path.abspath(os.path.join(os.environ.get("JAXSPEC_DATA", DATA), name))
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: the benchmarks read ../shared/data beside the repo "
                            "(or set JAXSPEC_DATA)")
  return path


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


def long_prompts(tokenizer, n: int, min_tokens: int = 16384, max_tokens: int = 32768,
                 seed: int = 0) -> list[list[int]]:
  """n chat prompts: a random Frankenstein passage of min..max tokens plus a question."""
  from jaxspec.io.loading import apply_chat_template
  with open(data_path("frankenstein.txt"), encoding="utf-8") as f:
    book = tokenizer.encode(f.read(), add_special_tokens=False)
  rng = random.Random(seed)
  prompts = []
  for i in range(n):
    length = rng.randint(min_tokens, max_tokens) - 64   # room for the template and question
    if length >= len(book):
      raise ValueError(f"a {length}-token passage does not fit the {len(book)}-token book")
    start = rng.randrange(0, len(book) - length)
    passage = tokenizer.decode(book[start:start + length])
    question = LONG_QUESTIONS[i % len(LONG_QUESTIONS)]
    prompts.append(tokenizer.encode(apply_chat_template(tokenizer, f"{passage}\n\n{question}"),
                                    add_special_tokens=False))
  return prompts
