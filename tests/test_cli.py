"""`python -m jaxspec.generate` end to end, and its error messages: what the model writes on the
real SmolLM2 GGUF, the flags' mechanics on a 2-layer random-weight cut of it (`tiny_smollm2_ckpt`)."""
import os
import subprocess
import sys

import pytest

from subproc import run_module_cases


def run_cli(*args, timeout=600, env=None):
  return subprocess.run([sys.executable, "-m", "jaxspec.generate", *args], capture_output=True,
                        text=True, timeout=timeout, env=env)


# What jaxspec.generate imports before it reads its flags.
GENERATE_DEPS = ("jax.numpy", "numpy", "absl.flags", "jaxspec.cli", "jaxspec.requests",
                 "jaxspec.ssv", "jaxspec.sts_map", "jaxspec.drafting.policies",
                 "jaxspec.drafting.specattn", "jaxspec.engine.sampling")


@pytest.fixture(scope="module")
def flag_runs(tmp_path_factory):
  """The flag checks below that fail before any model loads, each run as its own process but all
  forked from one Python that has done generate's imports (`subproc.run_module_cases`): some 30
  runs that would each spend a second importing. The runs of the UTF-8 and missing-model tests
  are plain subprocesses, whose whole stderr is checked.

  A function of (model path name, args) -> CompletedProcess (the model paths do not exist), with
  the planner profile the --plan cases name as its `plan`."""
  tmp = tmp_path_factory.mktemp("cli")
  plan = _plan_file(tmp)
  cases = ([[f"--model={tmp / 'nope'}", *args] for args, _ in BAD_FLAGS]
           + [[f"--model={tmp / 'nope'}", "--prompt=hi", *args] for args, _ in BAD_METHOD_FLAGS]
           + [[f"--model={tmp / 'nope'}", "--prompt=hi", f"--plan={plan}", *extra]
              for extra, _ in PLAN_FLAGS]
           + [[f"--model={tmp / 'never-loaded'}", "--prompt=hi", *args] for args, _ in DRAFT_FLAGS])
  runs = dict(zip(map(tuple, cases), run_module_cases("jaxspec.generate", cases, GENERATE_DEPS)))

  def run(model, *args):
    return runs[(f"--model={tmp / model}", *args)]
  run.plan = plan
  return run


def test_greedy_generation_prints_text_and_stats(weights_smollm2_gguf):
  res = run_cli(f"--model={weights_smollm2_gguf}", "--chat", "--dtype=float32",
                "--max_new_tokens=12", "--prompt=What is the capital of France?")
  assert res.returncode == 0, res.stderr[-2000:]
  assert "Paris" in res.stdout
  stats = [line for line in res.stderr.splitlines() if line.startswith("[jaxspec]")]
  assert len(stats) == 1 and "new tokens" in stats[0] and "tok/s" in stats[0]


def test_batch_from_prompt_file(tiny_smollm2_ckpt, tmp_path):
  prompts = tmp_path / "prompts.txt"
  prompts.write_text("The capital of France is\n\nOne, two, three,\n")
  res = run_cli(f"--model={tiny_smollm2_ckpt}", f"--prompt_file={prompts}",
                "--max_new_tokens=6", "--temperature=0.7", "--top_k=20", "--seed=3")
  assert res.returncode == 0, res.stderr[-2000:]
  assert res.stdout.count("=== [") == 2   # blank lines are skipped: two prompts, two completions


BAD_FLAGS = [
    (["--prompt=hi", "--max_len=1"], "--max_len must be an integer >= 2, got 1"),
    (["--prompt=hi", "--max_new_tokens=0"], "--max_new_tokens must be an integer >= 1, got 0"),
    (["--prompt=hi", "--top_p=0"], "top_p must be in (0, 1]"),
    (["--prompt=hi", "--temperature=-1"], "temperature must be >= 0"),
    (["--prompt=hi", "--method=vegas", "--gamma=0"], "--gamma must be an integer >= 1, got 0"),
    (["--prompt=hi", "--method=vegas", "--sparsity=1.5"], "sparsity ratio must be in (0, 1]"),
    (["--prompt=hi", "--method=quest", "--tree=2,1"], "method 'quest' drafts one token per step"),
    (["--prompt=hi", "--method=vegas", "--tree=2,x"], "--tree takes widths per depth"),
    (["--prompt=hi", "--method=vegas", "--tree=2,1", "--gamma=3"], "gamma 3 conflicts with"),
    (["--prompt=hi", "--method=vegas", "--min_tokens=-1"], "min_tokens must be a non-negative"),
    (["--prompt=hi", "--method=vegas", "--score_pool=4"],
     "--score_pool must be an odd integer >= 1, got 4"),
    (["--prompt=hi", "--method=vegas", "--score_block=0"],
     "--score_block must be an integer >= 1, got 0"),
    (["--prompt=hi", "--method=vegas", "--score_window=-4"],
     "--score_window must be an integer >= 0, got -4"),
    (["--prompt= "], "--prompt is empty"),
    (["--max_new_tokens=3"], "give exactly one of --prompt or --prompt_file"),
    (["--prompt=hi", "--fp8_drafts"],
     "--fp8_drafts is for speculative methods: --method=none drafts nothing"),
    (["--prompt=hi", "--method=vegas", "--fp8_drafts", "--tp=2"],
     "--fp8_drafts runs on one device (no --tp yet)"),
    (["--prompt=hi", "--compilation_cache=/dev/null/xla"],
     "--compilation_cache /dev/null/xla: cannot use it as a directory"),
]


@pytest.mark.parametrize("args, message", BAD_FLAGS)
def test_bad_flags_fail_in_one_line_before_the_model_loads(flag_runs, args, message):
  # The model does not exist: a flag error that names the flag was raised before loading it.
  res = flag_runs("nope", *args)
  assert res.returncode == 1
  assert res.stderr.startswith(f"jaxspec.generate: error: {message}"), res.stderr
  assert len(res.stderr.strip().splitlines()) == 1 and "nope" not in res.stderr


BAD_METHOD_FLAGS = [
    (["--method=specattn"], "--method=specattn needs --draft_model"),
    (["--method=specattn", "--draft_model=x", "--top_p_attn=0"],
     "top_p_attn (SpecAttn's kept attention mass) must be in (0, 1], got 0.0"),
    (["--method=specattn", "--draft_model=x", "--top_p_attn=1.01"], "must be in (0, 1], got 1.01"),
    (["--method=specattn", "--draft_model=x", "--attn_cap=0"], "--attn_cap must be an integer >= 1"),
    (["--method=specattn", "--draft_model=x", "--tree=2,1"], "builds its attention mask from a chain"),
    (["--method=vegas", "--draft_model=x"],
     "--draft_model is only for --method=draft, specattn, sts or ssv"),
    (["--method=ssv", "--ssv_class=fast"],
     "--ssv_class must be one of strict, reuse, approx, approx_reuse, got 'fast'"),
    (["--method=ssv", "--ssv_group=0"], "--ssv_group must be a positive number of verification"),
    (["--method=ssv", "--ssv_schedule=s.json"], "--ssv_schedule is for --ssv_class=reuse or"),
    (["--method=draft", "--draft_model=x", "--ssv_group=2"],
     "--ssv_group is only for --method=ssv, not --method=draft"),
    (["--method=sts"], "--method=sts needs --draft_model"),
    (["--method=sts", "--draft_model=x"], "the STS budget (keys each target head reads per round, "
     "besides the new tokens) must be an integer >= 1, got None"),
    (["--method=sts", "--draft_model=x", "--sts_budget=0"], "must be an integer >= 1, got 0"),
    (["--method=sts", "--draft_model=x", "--sts_budget=8", "--sts_block=0"],
     "--sts_block must be an integer >= 1"),
    (["--method=sts", "--draft_model=x", "--sts_budget=8", "--tree=2,1"],
     "method 'sts' builds its attention mask from a chain"),
]


@pytest.mark.parametrize("args, message", BAD_METHOD_FLAGS)
def test_bad_specattn_sts_and_ssv_flags_fail_in_one_line(flag_runs, args, message):
  res = flag_runs("nope", "--prompt=hi", *args)
  assert res.returncode == 1
  assert res.stderr.startswith("jaxspec.generate: error: ") and message in res.stderr, res.stderr
  assert len(res.stderr.strip().splitlines()) == 1


def test_prompt_file_that_is_not_utf8(tmp_path):
  bad = tmp_path / "latin1.txt"
  bad.write_bytes("caf\u00e9\n".encode("latin-1"))
  res = run_cli(f"--model={tmp_path / 'nope'}", f"--prompt_file={bad}")
  assert res.returncode == 1
  assert res.stderr == (f"jaxspec.generate: error: --prompt_file {bad} is not UTF-8 text "
                        "(byte 0xe9 at offset 3)\n")


def test_stats_line_counts_every_new_token_and_names_the_method_once(tiny_smollm2_ckpt):
  res = run_cli(f"--model={tiny_smollm2_ckpt}", "--method=vegas", "--gamma=3",
                "--min_tokens=16", "--max_new_tokens=8", "--prompt=One, two, three, four,")
  assert res.returncode == 0, res.stderr[-2000:]
  stats = res.stderr.strip().splitlines()[-1]
  assert stats.startswith("[jaxspec] ") and "new tokens 8 |" in stats   # was 7: prefill's left out
  assert stats.count("method") == 1 and "method vegas" in stats


def test_fused_and_separate_projections_generate_the_same_text(tiny_smollm2_ckpt):
  """On one device generate runs q/k/v and gate/up as one GEMM each unless told not to; in
  float32 the greedy text is the same either way."""
  args = (f"--model={tiny_smollm2_ckpt}", "--dtype=float32", "--max_new_tokens=12",
          "--prompt=One, two, three, four,")
  fused, apart = run_cli(*args), run_cli(*args, "--nofuse_projections")
  assert fused.returncode == 0, fused.stderr[-2000:]
  assert apart.returncode == 0, apart.stderr[-2000:]
  assert fused.stdout.strip() and fused.stdout == apart.stdout


def test_fp8_drafts_keep_vanilla_s_greedy_text(tiny_smollm2_ckpt):
  """--fp8_drafts: vegas drafts on FP8 MLP copies (the stats line says so) and, verifying with
  the model's own weights in float32, writes plain greedy decoding's text."""
  args = (f"--model={tiny_smollm2_ckpt}", "--dtype=float32", "--max_new_tokens=12",
          "--prompt=One, two, three, four,")
  vanilla, fp8 = run_cli(*args), run_cli(*args, "--method=vegas", "--fp8_drafts")
  assert vanilla.returncode == 0, vanilla.stderr[-2000:]
  assert fp8.returncode == 0, fp8.stderr[-2000:]
  assert fp8.stdout.strip() and fp8.stdout == vanilla.stdout
  stats = [line for line in fp8.stderr.splitlines() if line.startswith("[jaxspec]")]
  assert len(stats) == 1 and "method vegas" in stats[0] and "| drafts fp8" in stats[0]
  assert "drafts fp8" not in vanilla.stderr


def test_compilation_cache_holds_the_compiled_loops(tiny_smollm2_ckpt, tmp_path):
  """--compilation_cache: the first run stores its compiled prefill and decode loop there (by
  default xla/ in $JAXSPEC_CACHE); a second run loads every entry (it writes none) and prints the
  same text. A cache JAX was given ($JAX_COMPILATION_CACHE_DIR) stays the default; '' turns even
  that off."""
  cache = tmp_path / "xla"
  args = (f"--model={tiny_smollm2_ckpt}", "--max_new_tokens=8", "--prompt=One, two, three, four,")
  # The tiny model compiles in less than the second JAX needs before it stores a compile.
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAXSPEC_CACHE=str(tmp_path))
  first = run_cli(*args, env=env)
  assert first.returncode == 0, first.stderr[-2000:]
  stored = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
  assert {name.split("-")[0] for name in stored} >= {"jit__prefill", "jit__chunk"}, stored
  second = run_cli(*args, f"--compilation_cache={cache}", env=env)
  assert second.returncode == 0, second.stderr[-2000:]
  assert second.stdout == first.stdout
  assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stored
  elsewhere = dict(env, JAXSPEC_CACHE=str(tmp_path / "unused"),
                   JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax"))
  given = run_cli(*args, env=elsewhere)
  off = run_cli(*args, "--compilation_cache=",
                env=dict(elsewhere, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "off")))
  assert given.returncode == 0 and off.returncode == 0, given.stderr[-2000:] + off.stderr[-2000:]
  assert given.stdout == off.stdout == first.stdout
  assert any((tmp_path / "jax").iterdir())
  assert not (tmp_path / "unused").exists() and not (tmp_path / "off").exists()


def test_prompt_past_the_model_s_context(tiny_smollm2_ckpt, tmp_path):
  res = run_cli(f"--model={tiny_smollm2_ckpt}", "--prompt=hi", "--max_len=100000")
  assert res.returncode == 1
  assert res.stderr == ("jaxspec.generate: error: max_len=100000 exceeds the model's context of "
                        "8192 tokens (max_position_embeddings)\n")
  long = tmp_path / "long.txt"
  long.write_text("word " * 9000 + "\n")
  res = run_cli(f"--model={tiny_smollm2_ckpt}", f"--prompt_file={long}")
  assert res.returncode == 1
  assert res.stderr.startswith("jaxspec.generate: error: the prompt of 9")
  assert "exceeds the model's context of 8192 tokens" in res.stderr


def test_missing_model_is_named(tmp_path):
  res = run_cli(f"--model={tmp_path / 'nope'}", "--prompt=hi")
  assert res.returncode != 0
  assert "nope" in res.stderr and "no such checkpoint" in res.stderr


DRAFT_FLAGS = [
    (["--method=draft"], "--method=draft needs --draft_model"),
    (["--method=vegas", "--draft_model=smollm2-135m"], "--draft_model is only for --method=draft"),
]


@pytest.mark.parametrize("args, message", DRAFT_FLAGS)
def test_draft_model_flags_go_together(flag_runs, args, message):
  res = flag_runs("never-loaded", "--prompt=hi", *args)
  assert res.returncode != 0
  assert message in res.stderr.strip().splitlines()[-1]


def _plan_file(tmp_path, **drop):
  """A planner profile for SmolLM2: two vegas strategies in one bucket (minus the fields in
  `drop`)."""
  from jaxspec.engine.planner import Bucket, Expectation, Profile, Strategy
  a, b = Strategy("vegas", 3, 0.07), Strategy("vegas", 2, 0.1)
  d = Profile({a.key: a, b.key: b}, (Bucket(8192, 1, ((a.key, Expectation(3.0, 0.01)),
                                                      (b.key, Expectation(2.5, 0.01)))),)).to_json()
  for field in drop:
    del d[field]
  path = tmp_path / "plan.json"
  path.write_text(__import__("json").dumps(d))
  return path


PLAN_FLAGS = [
    (["--method=vegas"], "--plan chooses the strategy: drop --method"),
    (["--gamma=4", "--sparsity=0.1"], "--plan chooses the strategy: drop --gamma, --sparsity"),
    (["--ssv_class=approx"], "--plan chooses the strategy: drop --ssv_class"),
    (["--fp8_drafts"], "--fp8_drafts does not combine with --plan yet"),
]


@pytest.mark.parametrize("extra, message", PLAN_FLAGS)
def test_plan_flags_fail_in_one_line(flag_runs, extra, message):
  res = flag_runs("nope", "--prompt=hi", f"--plan={flag_runs.plan}", *extra)
  assert res.returncode == 1
  assert res.stderr == f"jaxspec.generate: error: {message}\n"


def test_plan_a_bad_profile_fails_in_one_line_before_the_model_loads(tmp_path):
  bad = _plan_file(tmp_path, buckets=None)
  res = run_cli(f"--model={tmp_path / 'nope'}", "--prompt=hi", f"--plan={bad}")
  assert res.returncode == 1
  assert res.stderr == f"jaxspec.generate: error: {bad}: missing field 'buckets'\n"
  res = run_cli(f"--model={tmp_path / 'nope'}", "--prompt=hi", f"--plan={tmp_path / 'absent'}")
  assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1
  assert "cannot read profile" in res.stderr


def test_plan_generates_with_the_planner(tiny_smollm2_ckpt, tmp_path):
  res = run_cli(f"--model={tiny_smollm2_ckpt}", f"--plan={_plan_file(tmp_path)}",
                "--min_tokens=16", "--max_new_tokens=8", "--prompt=One, two, three, four,")
  assert res.returncode == 0, res.stderr[-2000:]
  stats = res.stderr.strip().splitlines()[-1]
  assert "method plan" in stats and "strategy vegas/g3/r0.07" in stats, stats
