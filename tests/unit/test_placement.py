import pytest

from crosspool.placement import ModelLayers, PlacementError, place_layers

MIB = 2**20


def test_layers_spread_evenly_in_contiguous_ranges():
    models = [ModelLayers("a", [10 * MIB] * 30, ["f0", "f1", "f2"])]
    placed = place_layers(models, {"f0": 200 * MIB, "f1": 200 * MIB, "f2": 200 * MIB})
    assert placed == {"a": [["f0"]] * 10 + [["f1"]] * 10 + [["f2"]] * 10}


def test_pinned_model_stays_and_others_fill_around_it():
    models = [ModelLayers("big", [10 * MIB] * 8, ["f0"]), ModelLayers("small", [10 * MIB] * 4, ["f0", "f1"])]
    placed = place_layers(models, {"f0": 100 * MIB, "f1": 100 * MIB})
    assert placed["big"] == [["f0"]] * 8
    assert placed["small"] == [["f1"]] * 4


def test_budgets_follow_memory():
    models = [ModelLayers("a", [MIB] * 12, ["f0", "f1"])]
    placed = place_layers(models, {"f0": 3 * MIB, "f1": 9 * MIB})
    assert placed["a"].count(["f0"]) == 3 and placed["a"].count(["f1"]) == 9


def test_deterministic():
    models = [ModelLayers("a", [3 * MIB, 5 * MIB] * 7, ["f0", "f1"]), ModelLayers("b", [4 * MIB] * 9, ["f0", "f1"])]
    budgets = {"f0": 64 * MIB, "f1": 64 * MIB}
    assert all(place_layers(models, budgets) == place_layers(models, budgets) for _ in range(3))


def test_refusal_says_by_how_much():
    models = [ModelLayers("a", [2**30] * 3, ["f0", "f1"])]
    with pytest.raises(
        PlacementError, match=r"need 3.000 GiB on ffn_agent \['f0', 'f1'\] with 2.000 GiB .*1.000 GiB over"
    ):
        place_layers(models, {"f0": 2**30, "f1": 2**30})


def test_refusal_when_layers_do_not_pack():
    # 3 GiB total fits 2 x 1.6 GiB, but no agent can take two 1 GiB layers
    models = [ModelLayers("a", [2**30] * 3, ["f0", "f1"])]
    with pytest.raises(PlacementError, match="do not pack"):
        place_layers(models, {"f0": int(1.6 * 2**30), "f1": int(1.6 * 2**30)})


def test_tensor_parallel_groups():
    models = [ModelLayers("a", [12 * MIB] * 6, ["f0", "f1", "f2"], group=2), ModelLayers("b", [3 * MIB] * 2, ["f2"])]
    placed = place_layers(models, {"f0": 40 * MIB, "f1": 40 * MIB, "f2": 40 * MIB})
    assert all(len(g) == 2 and g == sorted(g) for g in placed["a"])
    load = {a: sum(6 * MIB for g in placed["a"] for x in g if x == a) for a in ("f0", "f1", "f2")}
    load["f2"] += 6 * MIB
    assert max(load.values()) <= 30 * MIB  # 42 MiB over three agents: the best split is 30/24/... or better


def test_shard_ranges_cover_uneven_sizes():
    from crosspool.agents.ffn.weights import shard_range

    assert [shard_range(1000, i, 3) for i in range(3)] == [(0, 334), (334, 667), (667, 1000)]
    assert [shard_range(256, i, 2) for i in range(2)] == [(0, 128), (128, 256)]


def test_plan_accounts_each_agent_its_share_of_the_weights(tiny_models):
    from crosspool.config import parse_deployment
    from crosspool.resolve import resolve

    path = tiny_models["qwen3"]
    agents = "".join(f'[[ffn_agent]]\nid = "f{i}"\nmemory_gib = 1\n' for i in range(3))
    body = f'[[model]]\nid = "a"\npath = "{path}"\nengine = "vllm"\nffn_tp = 2\n'
    resolved = resolve(parse_deployment(agents + body))
    plan = resolved.plan()
    total = resolved.specs["a"].weight_bytes("bfloat16")
    assert sum(a.weight_bytes for a in plan.ffn_agents) == total
    assert all(a.models == ["a"] for a in plan.ffn_agents if a.weight_bytes)


def _cpu_plan(text: str, host: list[int], monkeypatch):
    """The plan's CPU placement of a deployment as if this host allowed `host`."""
    from crosspool import cpus
    from crosspool.config import parse_deployment
    from crosspool.resolve import resolve

    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(host))
    return resolve(parse_deployment(text)).plan()


def _models(path: object, *specs: str) -> str:
    return "".join(f'[[model]]\nid = "m{i}"\npath = "{path}"\nengine = "vllm"\n{s}\n' for i, s in enumerate(specs))


@pytest.mark.parametrize(
    ("host", "specs", "control", "ranks", "agent", "spin"),
    [
        # a CPU no rank uses (the last, with everything off the chain): the FfnAgent there, both ends spin
        ([0, 1], [""], [1], {"m0": [[0]]}, [1], 2000),
        ([0, 1, 2, 3], [""], [3], {"m0": [[0, 1, 2]]}, [3], 2000),
        ([4, 5, 6], ["", ""], [6], {"m0": [[4]], "m1": [[5]]}, [6], 2000),
        # no more CPUs than ranks: ranks spread over all of them, control shares the last, the
        # FfnAgent shares its ranks' CPUs and both ends sleep
        ([0, 1], ["attention_tp = 2"], [1], {"m0": [[0], [1]]}, [0, 1], 0),
        ([0, 1], ["", ""], [1], {"m0": [[0]], "m1": [[1]]}, [0, 1], 0),
        ([0], ["attention_dp = 2"], [0], {"m0": [[0], [0]]}, [0], 0),
    ],
)
def test_cpu_plan_puts_each_ffn_agent_apart_from_its_ranks_where_it_can(
    tiny_models, monkeypatch, host, specs, control, ranks, agent, spin
):
    plan = _cpu_plan(_models(tiny_models["qwen3"], *specs), host, monkeypatch)
    assert plan.control_cpus == control
    assert {m.id: m.rank_cpus for m in plan.models} == ranks
    assert [a.cpus for a in plan.ffn_agents] == [agent]
    assert [a.spin_us for a in plan.ffn_agents] == [spin] and {m.spin_us for m in plan.models} == {spin}


def test_cpu_plan_follows_the_deployment_file_and_each_agent_its_models(tiny_models, monkeypatch):
    path = tiny_models["qwen3"]
    text = (
        "control_cpus = [0]\n"
        + '[[ffn_agent]]\nid = "fa"\n[[ffn_agent]]\nid = "fb"\ncpus = [3]\n'
        + _models(path, 'ffn_agent = "fa"\nrank_cpus = [[2], [1]]\nattention_tp = 2', 'ffn_agent = "fb"')
    )
    plan = _cpu_plan(text, [0, 1, 2, 3], monkeypatch)
    assert plan.control_cpus == [0]
    assert plan.model("m0").rank_cpus == [[2], [1]] and plan.model("m1").rank_cpus == [[2]]
    assert {a.id: a.cpus for a in plan.ffn_agents} == {"fa": [0, 3], "fb": [3]}  # fa: where no rank runs
    assert [m.spin_us for m in plan.models] == [2000, 2000] and [a.spin_us for a in plan.ffn_agents] == [2000, 2000]
    shared = _cpu_plan(text.replace("cpus = [3]", "cpus = [2]"), [0, 1, 2, 3], monkeypatch)
    assert [m.spin_us for m in shared.models] == [2000, 0]  # m1's rank and its FfnAgent share CPU 2
    assert {a.id: a.spin_us for a in shared.ffn_agents} == {"fa": 2000, "fb": 0}


def test_cpus_this_host_does_not_allow_are_refused(tiny_models, monkeypatch):
    from crosspool.config import ConfigError, parse_deployment

    text = "control_cpus = [7]\n" + _models(tiny_models["qwen3"], "rank_cpus = [[0], [9]]\nattention_dp = 2")
    with pytest.raises(ConfigError) as e:
        _cpu_plan(text, [0, 1], monkeypatch)
    assert e.value.problems == [
        "control_cpus: CPU 7 is not one this host allows (allowed: [0, 1]) (got [7])",
        "model[0].rank_cpus[1]: CPU 9 is not one this host allows (allowed: [0, 1]) (got [9])",
    ]
    with pytest.raises(ConfigError, match=r"rank_cpus: one CPU list per engine rank \(2\) \(got 1\)"):
        parse_deployment(_models(tiny_models["qwen3"], "rank_cpus = [[0]]\nattention_tp = 2"))
