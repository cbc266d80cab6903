"""``bench/replay.py``: the hot tier's own code replayed on its own clock, without model
compute (real MLX caches of zeros, the warm store as a count of segments)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvactor.actors.engine import turn_reserve_bytes
from kvactor.actors.hot import CachePool, LRUPolicy
from kvactor.actors.messages import Hint
from kvactor.actors.models import make_tiny_model
from kvactor.kernels.float_turn import FloatTurnCache
from kvactor.kernels.geometry import CacheGeometry
from kvactor.kernels.qcodec import DEFAULT_CODEC

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import _replay
import replay  # bench/ is not a package: its folder on sys.path
from _replay import Costs, ManifestBytes, Replay

COSTS = Costs(fixed_s=0.05, load_s=1e-4, dequantize_s=5e-5, prefill_s=1e-2)


def test_a_pool_weighs_its_caches_by_its_own_clock() -> None:
    """A tool wait lasts on the pool's clock, not the machine's: a replay moves it."""
    lm = make_tiny_model(0, head_dim=64)
    FloatTurnCache.prepare(lm.model)
    now = [100.0]
    pool = CachePool(
        None,
        LRUPolicy(),
        persistent=True,
        codec=DEFAULT_CODEC,
        geometry=lm.geometry,
        clock=lambda: now[0],
        wall=lambda: 1e9 + now[0],
    )
    entry = pool.claim("a")
    pool.end_turn("a", entry)
    assert entry.last_used == 100.0
    pool.tool_wait("a", 5.0)
    assert [c.waiting for c in pool.candidates()] == [True]
    now[0] = 104.0
    assert [c.waiting for c in pool.candidates()] == [True]
    now[0] = 106.0
    assert [c.waiting for c in pool.candidates()] == [False]


def test_costs_are_each_parts_seconds_over_its_tokens() -> None:
    turns = [
        {
            "path": "warm",
            "ttft_s": 1.6,
            "load_s": 0.2,
            "dequantize_s": 0.1,
            "prefill_s": 1.0,
            "reused_tokens": 1000,
            "prefilled_tokens": 100,
        },
        {
            "path": "hot",
            "ttft_s": 2.3,
            "load_s": 0.0,
            "dequantize_s": 0.2,
            "prefill_s": 2.0,
            "reused_tokens": 1000,
            "prefilled_tokens": 200,
        },
    ]
    costs = Costs.fit(turns)
    assert costs.load_s == pytest.approx(0.2 / 1000)
    assert costs.dequantize_s == pytest.approx(0.3 / 2000)
    assert costs.prefill_s == pytest.approx(3.0 / 300)
    assert costs.context_s == pytest.approx(0.0, abs=1e-12)
    assert costs.fixed_s == pytest.approx(0.2)  # the median of 0.3 and 0.1
    # A token prefilled after a longer context takes longer (attention): fitted as such.
    slower = (1.0 + 100 * 1050 * 1e-6, 2.0 + 200 * 1100 * 1e-6)
    for turn, seconds in zip(turns, slower, strict=True):
        turn["prefill_s"] = seconds
    costs = Costs.fit(turns)
    assert costs.prefill_s == pytest.approx(0.01) and costs.context_s == pytest.approx(1e-6)
    assert costs.prefill(300, 2000) == pytest.approx(300 * (0.01 + 1e-6 * 2150))


def test_the_workflow_policy_weighs_hints_on_the_replays_clock() -> None:
    """Two hot idle caches, both hinted, room for one of them beside a third agent's
    turn: the one hinted to run later goes first. (On the machine's clock every hint
    looked long past, so the policy fell back to least recently used and demoted the
    sooner one.)"""
    steps = [
        replay.Step(agent, reused=16, new=200, imported=16 if first else 0)
        for agent, first in (("a", True), ("b", True), ("c", True), ("a", False), ("b", False))
    ]
    geometry = CacheGeometry.uniform(1, 1, 64)
    probe = Replay(
        geometry=geometry,
        codec=DEFAULT_CODEC,
        policy=LRUPolicy(),
        budget=None,
        disk_limit=None,
        costs=COSTS,
    )
    # One turn's room and one and a half caches: a third agent's turn demotes one.
    budget = turn_reserve_bytes(geometry, 16 + 200 + 4) + 3 * probe.stored_bytes(219) // 2
    run = replay.replay(
        steps,
        ["a", "b", "c"],
        policy="workflow",
        geometry=geometry,
        budget=budget,
        disk_limit=None,
        costs=COSTS,
        brief=16,
        brief_hot=True,
    )
    demoted = [m[1] for m in run.turns[2]["moves"] if m[0] == "demoted" and m[1] != "brief"]
    assert demoted[:1] == ["b"], run.turns[2]["moves"]
    assert [t["path"] for t in run.turns[3:]] == ["hot", "hot"]  # b staged ahead of its turn


def run(
    policy: str,
    steps: list[replay.Step],
    agents: list[str],
    limits: tuple[int | None, int | None],
    *,
    settled: bool = False,
    lookahead: int | None = None,
    hint_every: int = 1,
) -> Replay:
    return replay.replay(
        steps,
        agents,
        policy=policy,
        geometry=CacheGeometry.uniform(1, 1, 64),
        budget=limits[0],
        disk_limit=limits[1],
        costs=COSTS,
        brief=168,
        brief_hot=True,
        settled=settled,
        lookahead=lookahead,
        hint_every=hint_every,
    )


def test_a_replay_hints_the_next_few_agents_or_every_few_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # --lookahead K names the next K agents alone; --hint-every E hints before every E-th
    # step alone (the done hints after an agent's last step still come).
    steps, agents = replay.scale_trace(27, seed=3)
    orders: list[int] = []  # the length of each order the pool was given
    hint = CachePool.hint

    def told(pool: CachePool, given: Hint, **kw: int) -> None:
        if given.next:
            orders.append(len(given.next))
        hint(pool, given, **kw)

    monkeypatch.setattr(CachePool, "hint", told)
    seen = {}
    ways = {"all": (None, 1), "window": (3, 1), "sparse": (None, 5)}
    for name, (window, every) in ways.items():
        orders.clear()
        run("workflow", steps, agents, (None, None), lookahead=window, hint_every=every)
        seen[name] = list(orders)
    assert len(seen["all"]) == len(steps) - 1  # the last step has no agent after it
    assert max(seen["all"]) == len(agents)
    assert seen["window"] == [min(n, 3) for n in seen["all"]]
    assert seen["sparse"] == seen["all"][::5]


@pytest.mark.slow  # a bench's run, seconds: the whole suite's
def test_a_replay_under_pressure_is_deterministic_and_within_its_limits() -> None:
    steps, agents = replay.scale_trace(27, seed=3)
    result = replay.at_scale(27, COSTS, seed=3)
    assert result["within_budget"] and result["within_disk_limit"]
    runs = result["policies"]
    assert sorted(runs) == sorted(replay.POLICIES)
    # Pressure: turns come back from disk and from re-prefill, and the oracle, which
    # knows the trace, wins over LRU.
    assert runs["lru"]["cold_turns"] > 0 and runs["lru"]["warm_reloads"] > 0
    assert runs["oracle"]["summed_excess_s"] < runs["lru"]["summed_excess_s"]
    assert result["oracle_vs_lru"] < 1
    # The same trace and policy decide the same way again, move for move.
    limits = (result["budget_bytes"], result["disk_limit_bytes"])
    first, again = run("workflow", steps, agents, limits), run("workflow", steps, agents, limits)
    assert [(t["path"], t["moves"]) for t in first.turns] == [
        (t["path"], t["moves"]) for t in again.turns
    ]
    assert {t["path"] for t in first.turns} <= {"hot", "warm", "cold"}
    assert first.pool.peak <= limits[0]
    assert first.disk_used() == first.recount() > 0
    # Unbounded, nothing is demoted: an agent's first turn reads its import, the rest
    # find it hot.
    free = run("lru", steps, agents, (None, None))
    assert [m for t in free.turns for m in t["moves"] if m[0] == "demoted"] == []
    seen: set[str] = set()
    for t in free.turns:
        assert t["path"] == ("hot" if t["agent"] in seen else "warm")
        seen.add(t["agent"])


@pytest.mark.parametrize("settled", [False, True], ids=["raced", "settled"])
def test_a_settled_replay_stages_a_hint_s_agents_before_the_step(
    settled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``bench/agentic.py --settle`` awaits a hint's stagings before the step: its replay
    # stages them first at every hinted step. Without it a hot turn starts first and the
    # stagings find room once it ended (as most real runs have it).
    steps, agents = replay.scale_trace(27, seed=3)
    order: list[tuple[int, str]] = []
    staged, started = Replay._prefetch, CachePool.start_turn

    def stage(self: Replay, hint: object) -> None:
        order.append((len(self.turns), "stage"))
        staged(self, hint)  # type: ignore[arg-type]

    def start(self: CachePool, *args: object, **kwargs: object) -> bool:
        order.append((-1, "turn"))
        return started(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Replay, "_prefetch", stage)
    monkeypatch.setattr(CachePool, "start_turn", start)
    played = run("workflow", steps, agents, (None, None), settled=settled)
    kinds = [kind for _, kind in order]
    assert kinds.count("stage") == kinds.count("turn") == len(steps)  # one hint a step
    pairs = list(zip(kinds[::2], kinds[1::2], strict=True))
    if settled:
        assert set(pairs) == {("stage", "turn")}
    else:  # the first turn is warm (an import): its stagings go first, then hot turns
        hot = [t["path"] == "hot" for t in played.turns]
        assert any(hot) and pairs[0] == ("stage", "turn")
        assert ("turn", "stage") in pairs


def test_a_manifest_s_bytes_a_token_are_fitted_apart_for_warm_and_cold() -> None:
    seg = _replay.MANIFEST_PER_SEGMENT
    samples = [
        [100, 2, 0, 900 + 2 * seg + 700],  # warm: 7 bytes a token, 900 fixed
        [300, 1, 0, 900 + seg + 2100],
        [50, 0, 1, 900 + 200],  # cold: 4 bytes a token
        [0, 0, 1, 900],  # nothing held: left out
    ]
    got = ManifestBytes.fit(samples)
    assert (got.per_token, got.cold_per_token, got.fixed) == pytest.approx((7.0, 4.0, 900.0))
    # Too few to fit: the default model's figures (runs before manifests were listed).
    assert ManifestBytes.fit([]) == ManifestBytes() == ManifestBytes.fit(samples[:1])
    warm = ManifestBytes.fit(samples[:2])
    assert warm.per_token == pytest.approx(7.0) and warm.cold_per_token == _replay.COLD_PER_TOKEN


def test_a_tiny_real_run_replays_with_its_own_manifests(tmp_path: Path) -> None:
    # The replay counted every manifest at the default model's 22 bytes a token; the tiny
    # model's byte tokens spell out in ~6, so its directory was counted full too early
    # and warm agents went cold a step before the real run's (moves equal at 7 of 15
    # steps on seed 0). A real run lists its manifests' sizes now, and the replay fits
    # them: the fit must give each real manifest's size closely, and the replay take
    # every turn's path as the real run did.
    bench = Path(__file__).resolve().parent.parent / "bench"
    out = tmp_path / "agentic.json"
    command = [sys.executable, str(bench / "agentic.py"), "--quick", "--settle", "--no-http"]
    command += ["--shapes", "pressure", "--json", str(out)]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    pressure = json.loads(out.read_text())["pressure"]
    samples = [m for r in pressure["policies"].values() for m in r["manifests"]]
    assert {m[2] for m in samples} == {0, 1}  # warm and cold manifests both
    fit = ManifestBytes.fit(samples)
    assert fit.fixed is not None
    assert 2 < fit.per_token < 12 and 2 < fit.cold_per_token < 12
    for tokens, files, cold, nbytes in samples:
        per = fit.cold_per_token if cold else fit.per_token
        guess = fit.fixed + per * tokens + _replay.MANIFEST_PER_SEGMENT * files
        assert abs(guess / nbytes - 1) < 0.1, (tokens, files, cold, nbytes)
    check = replay.against_real(pressure, replay.default_geometry("tiny"))
    assert check["manifest_bytes"] == dataclasses.asdict(fit)
    assert check["paths_equal"] == 1.0
    assert check["moves_equal"] >= 0.75  # a cold demotion may fall a step apart
