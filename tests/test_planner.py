"""The planner: ranking from a profile, run-time refinement on synthetic acceptance traces, the
profile file, and one planned generation that must equal plain greedy decoding."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.engine.planner import (Planner, Profile, ProfileError, Refinement, Strategy, Tally,
                                    parse_strategy)

A = Strategy("vegas", 6, 0.07)
B = Strategy("vegas", 4, 0.07)
C = Strategy("vegas-all", 3, 0.1)
T = Strategy("vegas", 2, 0.2, tree=(2, 1))
FAST_APPROX = Strategy("vegas", 8, 0.05, precision="approx")   # a label the planner must not cross


def make_profile(buckets, strategies=(A, B, C, T, FAST_APPROX)) -> Profile:
  """buckets: {(context, batch): {strategy: (accepted per round, round seconds)}}."""
  from jaxspec.engine.planner import Bucket, Expectation
  return Profile({s.key: s for s in strategies},
                 tuple(Bucket(c, b, tuple((s.key, Expectation(*e)) for s, e in entries.items()))
                       for (c, b), entries in buckets.items()))


ONE_BUCKET = {(4096, 1): {A: (5.0, 1.0), B: (4.0, 1.0), C: (2.0, 1.0), FAST_APPROX: (9.0, 1.0)}}
SETTINGS = Refinement(alpha=0.3, warmup_rounds=16, margin=0.1, patience=2, max_switches=2)


def run_trace(planner, trace, context=100, batch=1, rounds=8):
  """Feed a controller one chunk of `rounds` rounds per accepted-per-round value in `trace`;
  returns the controller and the strategy that ran each chunk."""
  control = planner.controller(context, batch)
  ran = []
  for x in trace:
    ran.append(control.strategy)
    control.observe(rounds, x, context)
  return control, ran


def test_ranks_by_accepted_tokens_per_second_within_the_class():
  profile = make_profile({(4096, 1): {A: (5.0, 2.0), B: (4.0, 1.0), C: (2.0, 1.0),
                                      FAST_APPROX: (9.0, 1.0)}})
  planner = Planner(profile, "exact", SETTINGS)
  assert [s for s, _ in planner.ranking(profile.buckets[0])] == [B, A, C]
  assert planner.controller(100, 1).strategy == B


def test_falls_to_the_next_ranked_when_the_ema_stays_below_expectation():
  planner = Planner(make_profile(ONE_BUCKET), "exact", SETTINGS)
  control, ran = run_trace(planner, [3.8] * 8)
  # Chunks of 8 rounds: rounds 16 and 24 are the first two checks past the warm-up (16), both
  # below 0.9 * 5.0, so A falls after round 24; 3.8 is within the margin of B's 4.0: B stays.
  assert ran == [A, A, A, B, B, B, B, B]
  assert [(e["from"], e["to"], e["reason"], e["round"]) for e in control.log] == [
      (A.key, B.key, "fall", 24)]
  assert control.switches == 1


def test_a_short_dip_does_not_switch():
  planner = Planner(make_profile(ONE_BUCKET), "exact", SETTINGS)
  # A dip inside the warm-up, then one chunk below after it (patience is two checks).
  control, ran = run_trace(planner, [1.0, 1.0, 5.0, 1.0, 5.0, 5.0, 1.0, 5.0, 5.0, 5.0])
  assert set(ran) == {A} and control.log == [] and control.switches == 0
  # The same dip held for two checks does switch: the test above could not pass by never
  # switching.
  control, _ = run_trace(planner, [1.0, 1.0, 5.0, 1.0, 1.0, 5.0])
  assert [e["reason"] for e in control.log] == ["fall"]


def test_switches_are_bounded_and_stay_in_the_class():
  for bound in (0, 1, 2, 3):
    planner = Planner(make_profile(ONE_BUCKET), "exact",
                      Refinement(warmup_rounds=8, patience=1, max_switches=bound))
    control, ran = run_trace(planner, [0.5] * 200)
    # Three exact strategies: after two falls none is left that promises more than the current.
    assert control.switches == len(control.log) == min(bound, 2)
    assert all(s.precision == "exact" for s in ran)
    assert FAST_APPROX not in ran
  # Random traces over contexts that cross buckets where the other class ranks first.
  rng = np.random.default_rng(0)
  profile = make_profile({(256, 1): {A: (5.0, 1.0), B: (4.0, 1.0), FAST_APPROX: (9.0, 0.1)},
                          (4096, 1): {C: (5.0, 1.0), T: (4.0, 1.0), FAST_APPROX: (9.0, 0.1)}})
  for seed in range(20):
    planner = Planner(profile, "exact", Refinement(warmup_rounds=4, patience=1, max_switches=2))
    control = planner.controller(100, 1)
    for context in np.sort(rng.integers(100, 8000, 60)):
      assert control.strategy.precision == "exact"
      control.observe(int(rng.integers(1, 9)), float(rng.uniform(0.5, 6.0)), int(context))
    assert control.switches <= 2 and sum(e["reason"] == "fall" for e in control.log) <= 2
  # The approximate class alone: its one strategy, never an exact one, whatever the trace.
  planner = Planner(make_profile(ONE_BUCKET), "approx", SETTINGS)
  control, ran = run_trace(planner, [0.5] * 50)
  assert set(ran) == {FAST_APPROX} and control.log == []


def test_goes_back_to_the_best_strategy_it_tried_when_that_beats_the_untried():
  planner = Planner(make_profile(ONE_BUCKET), "exact",
                    Refinement(warmup_rounds=8, patience=1, max_switches=2))
  # A delivers 4.0 (< 4.5, so it falls to B), B delivers 1.0: A's observed 4.0 tokens per second
  # beat C's profiled 2.0, so the second move goes back to A rather than on to C.
  control = planner.controller(100, 1)
  trace = {A: 4.0, B: 1.0, C: 2.0}
  for _ in range(10):
    control.observe(8, trace[control.strategy], 100)
  assert [(e["from"], e["to"]) for e in control.log] == [(A.key, B.key), (B.key, A.key)]
  assert control.strategy == A


def test_replans_when_the_context_crosses_into_another_bucket():
  profile = make_profile({(256, 1): {A: (5.0, 1.0), B: (4.0, 1.0), FAST_APPROX: (9.0, 0.1)},
                          (4096, 1): {A: (5.0, 2.0), B: (4.0, 1.0), T: (3.0, 1.0),
                                      FAST_APPROX: (9.0, 0.1)},
                          (4096, 8): {T: (3.0, 0.1), A: (5.0, 1.0)}})
  planner = Planner(profile, "exact", SETTINGS)
  assert planner.controller(100, 1).strategy == A
  assert planner.controller(100, 8).strategy == T    # batch sizes rank on their own
  assert planner.controller(100, 3).strategy == T    # the next profiled batch size up
  assert planner.controller(9999, 1).strategy == B   # past the last bucket: the last bucket
  control = planner.controller(100, 1)
  for context in (120, 200, 250, 300):
    control.observe(8, 5.0, context)
  assert [(e["from"], e["to"], e["reason"], e["context"]) for e in control.log] == [
      (A.key, B.key, "bucket", 300)]
  assert control.strategy == B and control.switches == 0   # a re-plan is not a fall
  assert control.expected.accepted == 4.0 and control.ema is None   # restarted for B
  control.observe(8, 5.0, 400)
  assert len(control.log) == 1 and control.ema == 5.0


def test_profile_round_trip(tmp_path):
  profile = make_profile({(256, 1): {A: (5.0, 1.0), T: (3.5, 0.5)},
                          (4096, 2): {B: (4.0, 1.0), FAST_APPROX: (9.0, 1.0)}})
  path = tmp_path / "plan.json"
  profile.save(path)
  back = Profile.load(path)
  assert back == profile
  assert Planner.load(path, "exact").ranking(back.buckets[0])[0][0] == T


def test_strategy_text_and_keys():
  assert parse_strategy("vegas:6@0.07") == A
  assert parse_strategy("vegas:t2.1@0.2") == T
  assert parse_strategy("vegas-all:3@0.1").key == "vegas-all/g3/r0.1"
  assert T.key == "vegas/t2-1-bfs/r0.2" and T.spare == 5 and A.spare == 7
  for bad in ("vegas:x", "quest:4", "vegas:0", "vegas:4@2", "vegas:t2.0", "vegas:t2,1"):
    with pytest.raises(ValueError) as e:
      parse_strategy(bad)
    assert "\n" not in str(e.value)


def test_ssv_strategies_text_keys_and_precision_classes():
  """SSV strategies: the class and group after '@', strict lossless ('exact'), every other class
  its own precision class; the fields round-trip through JSON; bad ones are one line."""
  strict = parse_strategy("ssv:4@strict.2")
  assert (strict.key, strict.precision, strict.group, strict.spare) == ("ssv/g4/strict.G2",
                                                                        "exact", 2, 5)
  approx = parse_strategy("ssv:t2.1/dfs@approx.4")
  assert (approx.key, approx.precision) == ("ssv/t2-1-dfs/approx.G4", "approx")
  assert parse_strategy("ssv:4") == Strategy("ssv", 4, ssv_class="strict", group=1)
  for s in (strict, approx):
    assert Strategy.from_json(json.loads(json.dumps(s.to_json()))) == s
  assert "ssv_class" not in A.to_json()          # self-drafting strategies' JSON is unchanged
  for bad, message in (("ssv:4@nope", "SSV class"), ("ssv:4@strict.0", "SSV group"),
                       ("ssv:4@strict.x", "cannot read")):
    with pytest.raises(ValueError, match=message):
      parse_strategy(bad)
  with pytest.raises(ValueError, match="settings of SSV strategies"):
    Strategy("vegas", 4, group=2)
  with pytest.raises(ValueError, match="precision class 'reuse', not 'approx'"):
    Strategy("ssv", 4, ssv_class="reuse", precision="approx")
  planner = Planner(make_profile({(4096, 1): {strict: (3.0, 1.0), approx: (9.0, 1.0)}},
                                 strategies=(strict, approx)), "exact")
  assert planner.strategies == (strict,)         # the approx strategy is of another class


def _good() -> dict:
  return make_profile(ONE_BUCKET).to_json()


def _drop(path):
  def edit(d):
    *head, last = path
    for k in head:
      d = d[k]
    del d[last]
  return edit


@pytest.mark.parametrize("edit, message", [
    (_drop(["buckets"]), "missing field 'buckets'"),
    (_drop(["buckets", 0, "context"]), "bucket 0: missing field 'context'"),
    (_drop(["buckets", 0, "entries", A.key, "round_s"]), "needs accepted_per_round and round_s"),
    (lambda d: d["buckets"][0]["entries"].update({"vegas/g9/r0.5": {
        "accepted_per_round": 2.0, "round_s": 1.0}}), "unknown strategy 'vegas/g9/r0.5'"),
    (lambda d: d["buckets"][0].update(entries={}), "has no entries"),
    (lambda d: d.update(buckets=[]), "'buckets' must be a non-empty list"),
    (lambda d: d["strategies"][A.key].update(method="quest"), "switches among methods"),
    (lambda d: d["buckets"][0]["entries"][A.key].update(round_s=0), "must be positive numbers"),
    (lambda d: d.update(version=99), "version 99"),
])
def test_a_bad_profile_is_one_line(tmp_path, edit, message):
  d = _good()
  edit(d)
  path = tmp_path / "bad.json"
  path.write_text(json.dumps(d))
  with pytest.raises(ProfileError) as e:
    Profile.load(path)
  assert message in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_broken_or_missing_file_is_one_line(tmp_path):
  path = tmp_path / "broken.json"
  path.write_text("{not json")
  with pytest.raises(ProfileError, match="not JSON"):
    Profile.load(path)
  with pytest.raises(OSError, match="cannot read profile"):
    Profile.load(tmp_path / "absent.json")
  with pytest.raises(ValueError, match="choose one"):
    Planner(make_profile(ONE_BUCKET))   # two classes: the caller must pick
  with pytest.raises(ValueError, match="no bucket of the profile measures a strategy of precision"):
    Planner(make_profile({(64, 1): {A: (5.0, 1.0)}}), "approx")   # defined, never measured


def test_tally_keeps_each_strategy_apart():
  tally = Tally()
  assert tally.chunk(np.array([[1, 2, 0], [0, 1, 1]]), 3) == (3, pytest.approx(10 / 5))
  assert tally.chunk(np.array([[1, 3, 0], [0, 1, 2]]), 5) == (2, pytest.approx(5 / 2))
  tally.close("a", np.array([[1, 3, 0], [0, 1, 2]]))
  tally.close("b", np.array([[0, 0, 0, 2]]))
  s = tally.summary()
  assert s["a"] == {"mean_accepted_tokens": round(15 / 7, 4), "verify_rounds": 7}
  assert s["b"] == {"mean_accepted_tokens": 4.0, "verify_rounds": 2}
  assert s["all"]["verify_rounds"] == 9


def test_profiling_then_planned_generation_equals_plain_greedy():
  """One runner (the compiled variants shared):
  - `benchmarks.plan_profile.profile` measures both strategies on the golden prompts: positive
    accepted tokens per round (at most gamma + 1) and round latencies, a profile that loads back;
  - planned generation switches mid-generation from a vegas chain (gamma 3, ratio 0.2) to a
    vegas-all (2, 1) tree at ratio 0.5 (another gamma, drafter, index width and draft shape) and
    its greedy float32 output equals plain greedy decoding: the vanilla output recorded in
    tests/golden for this model (`test_engine.py` checks that it still holds). The planner's
    inflated expectation for the chain forces the fall; the switch log is in the stats."""
  from benchmarks.plan_profile import profile
  from jaxspec.engine.runner import Runner
  from jaxspec.model.transformer import init_random
  from test_engine import GOLDEN
  from test_speculative import CFG, sharpen
  golden = json.loads(GOLDEN.read_text())
  plain = next(r["tokens"] for r in golden["runs"] if r["method"] == "none")
  model = sharpen(init_random(CFG, dtype=jnp.float32, seed=3))
  chain, tree = Strategy("vegas", 3, 0.2), Strategy("vegas-all", 2, 0.5, tree=(2, 1))
  inflated = make_profile({(4096, 4): {chain: (50.0, 1.0), tree: (1.0, 0.1)}},
                          strategies=(chain, tree))
  planner = Planner(inflated, refinement=Refinement(warmup_rounds=2, patience=1, max_switches=2))
  runner = Runner(model, planner=planner, min_tokens=golden["min_tokens"],
                  cache_dtype=jnp.float32)
  prompts, new = golden["prompts"], golden["max_new_tokens"]
  context = max(map(len, prompts)) + new     # the shapes `generate` below runs at
  measured = profile(runner, [chain, tree], [context], [len(prompts)], lambda b, n: prompts,
                     chunk=2, warmup_chunks=0, chunks=1)
  [bucket] = measured.buckets
  assert (bucket.context, bucket.batch) == (context, len(prompts))
  for (key, e), s in zip(bucket.entries, (chain, tree)):
    assert key == s.key and 1 <= e.accepted <= s.gamma + 1 and e.round_s > 0
  assert Profile.from_json(json.loads(json.dumps(measured.to_json()))) == measured

  out, stats = runner.generate(prompts, max_new_tokens=new, chunk=2)
  assert out == plain
  log = stats.extra["plan_switches"]
  assert [(e["from"], e["to"], e["reason"], e["round"]) for e in log] == [
      (chain.key, tree.key, "fall", 2)]     # the first chunk ends the warm-up, below 45
  per = stats.extra["plan_strategies"]
  assert set(per) == {chain.key, tree.key} and per[chain.key]["verify_rounds"] > 0
  assert sum(p["verify_rounds"] for p in per.values()) == stats.extra["verify_rounds"]
  assert stats.extra["method"] == "plan" and stats.extra["strategy"] == tree.key
  with pytest.raises(ValueError, match="leave them unset"):
    Runner(model, planner=planner, method="vegas")
