"""Pearson's goodness-of-fit test, shared by the exactness tests of speculative sampling."""
import jax
import numpy as np


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 0.0) -> float:
  """p-value of observed `counts` under `probs`; 0.0 when a zero-probability cell was observed.

  Cells expecting fewer than `min_expected` samples are pooled into one (the test's chi-square
  approximation wants about 5 per cell).
  """
  counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
  if (counts[probs == 0] > 0).any():   # something the target cannot produce was emitted
    return 0.0
  counts, expected = counts[probs > 0], probs[probs > 0] * counts.sum()
  big = expected >= min_expected
  obs, exp = counts[big], expected[big]
  if not big.all():
    obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, expected[~big].sum())
  stat = float(((obs - exp) ** 2 / exp).sum())
  return float(jax.scipy.special.gammaincc((len(obs) - 1) / 2, stat / 2))
