import json
import subprocess
import sys
from pathlib import Path

import pytest

from crosspool.config import ConfigError, parse_deployment
from crosspool.integrations.sglang.options import engine_arg_problems


def _toml(path: Path, extra: str = "", model_extra: str = "") -> str:
    return f'''
name = "t"
{extra}
[[model]]
id = "m"
path = "{path}"
engine = "vllm"
{model_extra}
'''


def test_valid_defaults(tiny_models):
    d = parse_deployment(_toml(tiny_models["qwen3"]))
    assert d.model[0].dtype == "bfloat16"
    assert d.attention_of(d.model[0]) == "atn0" and d.ffn_agents_of(d.model[0]) == ["ffn0"] and d.control == 8001
    assert d.digest() == parse_deployment(_toml(tiny_models["qwen3"])).digest()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[[model]\nid=", "malformed TOML"),
        (_toml(Path("/nonexistent/m")), "model[0].path: model path does not exist: '/nonexistent/m'"),
        (_toml(Path("/tmp"), model_extra='dtype = "int4"'), "model[0].dtype"),
        (_toml(Path("/tmp"), model_extra="bogus = 1"), "model[0].bogus: Extra inputs are not permitted (got 1)"),
    ],
)
def test_errors_name_field_and_value(text, needle):
    with pytest.raises(ConfigError) as e:
        parse_deployment(text)
    assert needle in str(e.value)


def test_unknown_references(tiny_models):
    with pytest.raises(ConfigError, match="unknown agent 'nope'"):
        parse_deployment(_toml(tiny_models["qwen3"], model_extra='ffn_agent = "nope"'))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "crosspool", *args], capture_output=True, text=True, timeout=120)


def test_config_check_prints_resolved(tmp_path, tiny_models):
    f = tmp_path / "d.toml"
    f.write_text(_toml(tiny_models["qwen3"]))
    r = _cli("config", "check", str(f))
    assert r.returncode == 0, r.stderr
    resolved = json.loads(r.stdout)
    assert resolved["ffn"]["m"]["architecture"] == "Qwen3ForCausalLM"
    assert resolved["ffn"]["m"]["layers"] == 2
    assert resolved["model"][0]["max_model_len"] == 2048


def _single_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("crosspool: error: ")
    return lines[0]


def test_bad_inputs_fail_with_one_line(tmp_path, tiny_models, no_leftovers):
    """`crosspool config check` names each problem in one line; `crosspool daemon` runs the same
    check and refuses before it starts any process."""
    unsupported = tmp_path / "unsupported"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    cases = {
        "malformed.toml": ("[[model]\n", "malformed TOML"),
        "nopath.toml": (_toml(tmp_path / "missing"), "model path does not exist"),
        "arch.toml": (
            _toml(unsupported),
            "architecture ['GPT2LMHeadModel'] is not supported; supported: DeepseekV2ForCausalLM, LlamaForCausalLM",
        ),
        "option.toml": (
            _toml(tiny_models["qwen3"], model_extra="engine_args = { enable_lora = true }"),
            "engine_args.enable_lora: not supported with CrossPool",
        ),
    }
    for name, (text, needle) in cases.items():
        f = tmp_path / name
        f.write_text(text)
        line = _single_error(_cli("config", "check", str(f)))
        assert needle in line, line
    line = _single_error(_cli("daemon", str(tmp_path / "option.toml")))
    assert "engine_args.enable_lora: not supported with CrossPool" in line, line


def test_memory_budget_refused_with_amount(tmp_path, tiny_models):
    f = tmp_path / "d.toml"
    f.write_text(_toml(tiny_models["qwen3"], extra='[[ffn_agent]]\nid = "ffn0"\nmemory_gib = 0.0001'))
    line = _single_error(_cli("config", "check", str(f)))
    assert "ffn_agent: FFN weights of ['m'] need" in line and "GiB over the budget" in line, line


def test_bench_subcommands_and_their_options():
    r = _cli("bench", "overhead", "--repeats", "1", "--help")
    assert r.returncode == 0 and "--round-trips" in r.stdout and "--engine" in r.stdout, r.stderr
    r = _cli("bench", "executor", "--help")
    assert r.returncode == 0 and "--threads" in r.stdout, r.stderr
    r = _cli("bench", "serve", "--help")
    assert r.returncode == 0 and "--trace" in r.stdout and "lognormal" in r.stdout, r.stderr
    r = _cli("bench", "elastic-kv", "--help")
    assert r.returncode == 0 and "--budget-gib" in r.stdout, r.stderr
    r = _cli("bench")
    assert r.returncode == 2 and all(b in r.stderr for b in ("overhead", "executor", "serve", "elastic-kv"))
    r = _cli("bench", "overhead")  # the report file is required
    assert r.returncode == 2 and "--out" in r.stderr


def test_cpu_binding_of_engine_workers():
    from crosspool.cpus import rank_cpus
    from crosspool.integrations import threads_bind

    assert threads_bind(rank_cpus(2, [0, 1])) == "0|1"
    assert threads_bind(rank_cpus(4, [0, 1])) == "0|1|0|1"
    assert threads_bind(rank_cpus(2, [0, 1, 2, 3, 4, 5])) == "0,1|2,3,4"  # the last CPU left to control
    assert threads_bind(rank_cpus(1, [0, 1])) == "0"


def test_sglang_command_and_refusals(tiny_models):
    from crosspool.integrations import launcher
    from crosspool.resolve import resolve

    d = parse_deployment(_toml(tiny_models["qwen3"]).replace('engine = "vllm"', 'engine = "sglang"\nattention_tp = 2'))
    sglang = launcher("sglang")
    argv = sglang.server_command(d.model[0], 512, "127.0.0.1", 9000)
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert argv[1:3] == ["-m", "sglang.launch_server"] and flags["--tp-size"] == "2" and flags["--device"] == "cpu"
    assert flags["--attention-backend"] == "torch_native" and flags["--chunked-prefill-size"] == "512"
    config = json.loads((tiny_models["qwen3"] / "config.json").read_text())
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    assert int(flags["--max-total-tokens"]) == 2**30 // per_token  # kv_cache_gib = 1, bf16
    env = sglang.engine_env(d.model[0], None, [[0], [1]])
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["SGLANG_PLUGINS"] == "crosspool"
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1" and env["OMP_NUM_THREADS"] == "1" and "CROSSPOOL_PLAN" not in env
    assert engine_arg_problems({"enable_torch_compile": True, "tp_size": 2, "enable_mixed_chunk": False}) == [
        "engine_args.enable_torch_compile: not supported with CrossPool: SGLang's CPU torch.compile decode graph "
        "is not qualified: CrossPool serves eager (got True)",
        "engine_args.tp_size: set by CrossPool from model.attention_tp (got 2)",
    ]
    dp = parse_deployment(_toml(tiny_models["qwen3"]).replace('engine = "vllm"', 'engine = "sglang"\nattention_dp = 2'))
    with pytest.raises(ConfigError, match=r"model\[0\]\.attention_dp: SGLang data parallelism is not qualified"):
        resolve(dp)
    moe = parse_deployment(_toml(tiny_models["qwen3_moe"]).replace('engine = "vllm"', 'engine = "sglang"'))
    with pytest.raises(ConfigError, match="Qwen3MoeForCausalLM is not served through sglang with CrossPool"):
        resolve(moe)


def test_restart_decision(tiny_models):
    from crosspool.daemon.restarts import no_restart, restart_backoff_s

    d = parse_deployment(_toml(tiny_models["qwen3"], extra="restart = true\nmax_restarts = 2"))
    assert no_restart(d, 2, "exit", 1, False) is None
    assert no_restart(d, 3, "heartbeat", 2, False) == "max_restarts = 2 reached within restart_window_s = 600"
    assert no_restart(d, 1, "startup", 0, False) is not None  # a configuration problem: not retried
    assert no_restart(d, 1, "exit", 0, False) is None  # a member of a started first generation failed
    assert no_restart(d, 2, "exit", 0, True) == "a stop was requested"
    assert no_restart(parse_deployment(_toml(tiny_models["qwen3"])), 1, "exit", 0, False) == "restart = false"
    assert [restart_backoff_s(d, n) for n in (0, 1, 2, 10)] == [1.0, 2.0, 4.0, 60.0]


def test_every_example_deployment_resolves(smollm2, tiny_served):
    """Each shipped example passes the deployment check (the two with SmolLM2 alone are also
    served in test_deployments.py, the context-parallel one by qualify's CP row)."""
    from conftest import EXAMPLES, example_text
    from crosspool.resolve import resolve

    names = sorted(p.stem for p in EXAMPLES.glob("*.toml"))
    assert names == ["context-parallel", "mixed-engines", "smollm2", "two-models"]
    for name in names:
        d = resolve(parse_deployment(example_text(name, 18000, 18001), name)).deployment
        if name == "context-parallel":  # the deployment qualify's CP row serves over HTTP
            from crosspool.qualify.serving import CP_MODEL

            qualified = parse_deployment(f'[[model]]\nid = "qwen3-cp2"\npath = "{tiny_served}"\n{CP_MODEL}').model
            assert d.model == qualified
            continue
        smollm2_models = [m for m in d.model if m.path == smollm2.resolve()]
        assert smollm2_models and all(m.dtype == "float32" for m in smollm2_models)  # the right answer on every CPU


def test_model_path_expands_the_cache_root_and_the_environment(tiny_models, monkeypatch):
    """`${CROSSPOOL_CACHE}` in a path is the cache root (CROSSPOOL_CACHE, default ~/.cache/crosspool),
    other variables come from the environment: the shipped examples serve from where `crosspool
    models prepare` wrote."""
    from crosspool import envs

    checkpoint = tiny_models["qwen3"]
    monkeypatch.delenv(envs.CACHE, raising=False)
    monkeypatch.setenv("HOME", str(checkpoint.parents[2]))  # the default root is ~/.cache/crosspool
    default_root = Path(checkpoint.parents[2] / ".cache" / "crosspool")
    with pytest.raises(ConfigError, match=f"model path does not exist: '{default_root}/tiny/tiny-qwen3'"):
        parse_deployment(_toml("${CROSSPOOL_CACHE}/tiny/tiny-qwen3"))
    monkeypatch.setenv(envs.CACHE, str(checkpoint.parents[1]))
    assert parse_deployment(_toml("${CROSSPOOL_CACHE}/tiny/tiny-qwen3")).model[0].path == checkpoint.resolve()
    monkeypatch.setenv("CHECKPOINT", str(checkpoint))
    assert parse_deployment(_toml("$CHECKPOINT")).model[0].path == checkpoint.resolve()


def test_elastic_kv_plan_and_refusals(tiny_models):
    from crosspool.resolve import resolve

    device = '[[attention_device]]\nid = "atn0"\nkv_budget_gib = 3'
    d = parse_deployment(_toml(tiny_models["llama"], device, "attention_tp = 2\nkv_cache_gib = 2\nkv_floor_gib = 0.5"))
    plan = resolve(d).plan()
    assert [p.budget_bytes for p in plan.kv_pools] == [3 * 2**30]
    (group,) = plan.kv_groups  # one DP rank: one group over both TP ranks
    assert (group.floor_bytes, group.ceiling_bytes) == (2**30, 4 * 2**30) and group.name.startswith(plan.shm_prefix)
    assert plan.kv_group("m", 0) == group and plan.kv_group("m", 1) is None
    with pytest.raises(ConfigError, match=r"kv_budget_gib: less than its models' floors \(kv_floor_gib x ranks = 4\)"):
        parse_deployment(_toml(tiny_models["llama"], device, "attention_tp = 2\nkv_cache_gib = 2\nkv_floor_gib = 2"))
    with pytest.raises(ConfigError, match=r"model\[0\]: kv_floor_gib: more than kv_cache_gib \(1\) \(got 1.5\)"):
        parse_deployment(_toml(tiny_models["llama"], device, "kv_floor_gib = 1.5"))
    sglang = _toml(tiny_models["llama"], device, "engine_args = { page_size = 16 }")
    with pytest.raises(ConfigError, match=r"model\[0\].engine_args.page_size: .*single token slots"):
        resolve(parse_deployment(sglang.replace('engine = "vllm"', 'engine = "sglang"')))
    assert resolve(parse_deployment(_toml(tiny_models["llama"]))).plan().kv_groups == []
