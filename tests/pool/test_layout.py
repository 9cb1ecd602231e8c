"""Pure layout arithmetic and pool-spec validation (no servers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backends.base import InstanceSpec
from gateway.pool.layout import InstanceRequest, LayoutError, diff, place, resize, select_gpus
from gateway.pool.spec import PoolSpecError, load_pool_spec, parse_pool_spec

EIGHT = [("local", g) for g in range(8)]


def spec(tp: int, *gpus: int, node: str = "local") -> InstanceSpec:
    name = f"tp{tp}-g" + "-".join(map(str, gpus))
    return InstanceSpec(id=name, model="m", tp=tp, gpus=gpus, node=node)


def test_place_fills_gpus_in_order_and_names_by_placement() -> None:
    specs = place([InstanceRequest(tp=1)] * 4 + [InstanceRequest(tp=4)], EIGHT, "m")
    assert [s.id for s in specs] == ["tp1-g0", "tp1-g1", "tp1-g2", "tp1-g3", "tp4-g4-5-6-7"]


def test_place_reuses_running_placements_so_they_keep_serving() -> None:
    current = [spec(2, 4, 5)]
    specs = place([InstanceRequest(tp=2)], EIGHT, "m", current)
    assert specs == current


def test_explicit_gpus_win_and_are_checked() -> None:
    specs = place([InstanceRequest(tp=1), InstanceRequest(tp=1, gpus=(0,))], EIGHT[:2], "m")
    assert sorted(s.id for s in specs) == ["tp1-g0", "tp1-g1"]
    with pytest.raises(LayoutError, match="used twice"):
        place([InstanceRequest(tp=1, gpus=(0,))] * 2, EIGHT, "m")


def test_multi_node_keeps_tp_within_one_node() -> None:
    two_nodes = [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    specs = place([InstanceRequest(tp=1), InstanceRequest(tp=2)], two_nodes, "m")
    assert [(s.node, s.gpus, s.id) for s in specs] == [("a", (0,), "a-tp1-g0"),
                                                       ("b", (0, 1), "b-tp2-g0-1")]
    with pytest.raises(LayoutError, match="no node has 4 free GPUs"):
        place([InstanceRequest(tp=4)], two_nodes, "m")


def test_diff_keeps_unchanged_placements() -> None:
    plan = diff([spec(1, 0), spec(1, 1), spec(1, 2)], [spec(1, 0), spec(2, 1, 2)])
    assert plan.describe() == {"keep": ["tp1-g0"], "stop": ["tp1-g1", "tp1-g2"],
                               "start": ["tp2-g1-2"]}


def test_select_gpus_keeps_whole_instances_first() -> None:
    current = [spec(1, 0), spec(1, 1), spec(1, 2), spec(1, 3), spec(4, 4, 5, 6, 7)]
    assert select_gpus(EIGHT, current, 4) == EIGHT[:4]
    assert select_gpus(EIGHT, [spec(4, 4, 5, 6, 7), spec(1, 0)], 5) == [EIGHT[0], *EIGHT[4:]]
    with pytest.raises(LayoutError):
        select_gpus(EIGHT, current, 9)


def test_resize_fills_freed_gpus_with_the_default_tp() -> None:
    reqs = resize([spec(1, 0)], EIGHT[:6], default_tp=2)
    assert [(r.tp, r.gpus) for r in reqs] == [(1, (0,)), (2, (1, 2)), (2, (3, 4)), (1, (5,))]


def _spec(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "inventory": {"gpus": 4}, "launcher": {"kind": "sim"}, **kw}


@pytest.mark.parametrize(("data", "message"), [
    (_spec(layout=[{"tp": 8}]), "no node has 8 free GPUs"),
    (_spec(launcher={"kind": "k8s"}), "launcher"),
    (_spec(inventory={"gpus": 2, "nodes": [{"gpus": 2}]}), "either 'gpus' or 'nodes'"),
    (_spec(layout=[{"tp": 1, "count": 2, "gpus": [0]}]), "'count' > 1"),
    (_spec(inventory={}), "inventory declares no GPUs"),
    (_spec(surprise=1), "surprise"),
    ({"model": "m", "launcher": {"kind": "static", "backends": []}}, "backends"),
])
def test_invalid_specs_say_what_is_wrong(data: dict[str, Any], message: str) -> None:
    with pytest.raises(PoolSpecError, match="is invalid") as err:
        parse_pool_spec(data)
    assert message in str(err.value)


def test_spec_files_yaml_json_and_errors(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text(
        "model: m\ninventory: {nodes: [{name: n1, gpus: [2, 3]}]}\nlauncher: {kind: sim}\n"
        "layout:\n  - {tp: 2}\n")
    spec_ = load_pool_spec(tmp_path / "p.yaml")
    assert spec_.inventory.slots() == [("n1", 2), ("n1", 3)]
    (tmp_path / "p.json").write_text('{"model": "m", "launcher": {"kind": "sim"}, "inventory"')
    with pytest.raises(PoolSpecError, match="does not parse"):
        load_pool_spec(tmp_path / "p.json")
    with pytest.raises(PoolSpecError, match="No such file"):
        load_pool_spec(tmp_path / "missing.yaml")


@pytest.mark.parametrize("path", sorted(Path(__file__).parents[2].glob("examples/pool*.yaml")))
def test_example_specs_are_valid(path: Path) -> None:
    load_pool_spec(path)


def test_a_simulated_pool_sets_its_engines_context() -> None:
    """``max_model_len`` under a ``sim`` launcher: each engine's context (default: the
    profile model's own, Qwen3's 40,960)."""
    from gateway.pool.spec import build_launcher

    def context(launcher: dict[str, Any]) -> int:
        spec = parse_pool_spec({"model": "policy-a", "inventory": {"gpus": 1},
                                "launcher": {"kind": "sim", **launcher}})
        built: Any = build_launcher(spec)
        return int(built.config_for(InstanceSpec(id="i0", model="policy-a", tp=1,
                                                 gpus=(0,))).context_len)

    assert context({}) == 40960
    assert context({"max_model_len": 131072}) == 131072
    assert context({"profile": "llama3.1-8b"}) == 131072
    with pytest.raises(PoolSpecError, match="max_model_len"):
        parse_pool_spec({"model": "m", "launcher": {"kind": "sim", "max_model_len": 0}})


def test_a_probe_layout_runs_every_degree_each_node_holds() -> None:
    """``layout: probe``: replay chooses from speeds the engines measured, and a degree
    no engine ran borrows another's; the probe start has every degree measured (per node:
    an instance never spans two)."""
    one = parse_pool_spec({"model": "m", "inventory": {"gpus": 16}, "launcher": {"kind": "sim"},
                           "layout": "probe"})
    assert [r.tp for r in one.requests()] == [8, 4, 2, 1, 1]
    two = parse_pool_spec({"model": "m", "launcher": {"kind": "sim"}, "layout": "probe",
                           "inventory": {"nodes": [{"name": "a", "gpus": 8},
                                                   {"name": "b", "gpus": 4}]}})
    assert [r.tp for r in two.requests()] == [4, 2, 2, 1, 1, 1, 1]
    placed = place(two.requests(), two.inventory.slots(), "m")
    assert sum(len(p.gpus) for p in placed) == 12


def test_a_lora_pool_starts_its_engines_with_lora_on() -> None:
    """``launcher.lora`` turns into vLLM's flags and environment (a Ray actor gets the
    same) and into the simulated servers' options."""
    from backends.base import InstanceSpec
    from backends.sim_launcher import SimLauncher
    from backends.vllm_local import LocalVLLMLauncher
    from gateway.pool.spec import build_launcher

    vllm = parse_pool_spec(_spec(launcher={
        "kind": "vllm", "extra_args": ["--dtype", "bfloat16"], "env": {"A": "1"},
        "lora": {"max_rank": 32, "slots": 3}}))
    launcher = build_launcher(vllm)
    assert isinstance(launcher, LocalVLLMLauncher)
    argv = launcher.command(InstanceSpec(id="i0", model="m", gpus=(0,)), 8000)
    assert argv[-7:] == ["--dtype", "bfloat16", "--enable-lora", "--max-loras", "3",
                         "--max-lora-rank", "32"]
    assert launcher.env == {"A": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    ray = parse_pool_spec(_spec(launcher={"kind": "ray", "vllm": {"lora": {}}}))
    kwargs = ray.launcher.vllm.launcher_kwargs()  # type: ignore[union-attr]
    assert "lora" not in kwargs and kwargs["extra_args"][-1] == "16"
    LocalVLLMLauncher(**kwargs)  # what the Ray actor builds from them
    sim = build_launcher(parse_pool_spec(_spec(launcher={"kind": "sim",
                                                         "lora": {"max_rank": 8}})))
    assert isinstance(sim, SimLauncher)
    assert (sim.template.enable_lora, sim.template.max_lora_rank) == (True, 8)
    assert build_launcher(parse_pool_spec(_spec())).template.enable_lora is False  # type: ignore[attr-defined]
    with pytest.raises(PoolSpecError, match="slots"):
        parse_pool_spec(_spec(launcher={"kind": "sim", "lora": {"slots": 0}}))
