"""`python -m benchmarks.vae` runs end to end at a tiny size (so it never rots), its
sharded runs match one device's public calls, and its counters count what they claim.

The tiny configs keep each model's structure (causal convs, norms, attention, temporal
down- and upsampling) with a few channels; 9 frames at 32 px give every model 2-3 latent
frames, so 2 ranks hold 1-2 each.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from haloshard.testing import GlooWorld

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not installed
    sys.path.insert(0, str(ROOT))

pytest.importorskip("diffusers")

from benchmarks import vae  # noqa: E402

# float32 throughout. Inference: the sharded run computes the same products, summed in
# another order in the windowed convs and the all-gathered norm statistics: measured 3e-6
# of the output's largest value at most. Training adds the backward of ~50 layers and
# parameter gradients summed over ranks: measured 5e-4 at most (Mochi: float32 sums over
# its per-pixel attention along T). A wrong or missing frame is O(1).
REL_TOL = {"decode": 1e-4, "encode": 1e-4, "train": 5e-3}
TINY = ["--config", "tiny", "--frames", "9", "--size", "32", "--warmup", "0",
        "--timeout", "300"]


def _check(records: list[dict[str, Any]], modes: list[str], models: list[str]) -> None:
    """One device and P = 2 on T and on H for every model (LTX-Video's patch_size=4
    included); with `--floor`, one device on a rank's share beside every P = 2 run, and
    with `--floor-plus` on one latent frame more beside every P = 2 run on T."""
    floors = {(r["model"], r["mode"], r["P"], tuple(r["dims"]), r["floor"]): r
              for r in records if r.get("floor")}
    records = [r for r in records if not r.get("floor")]
    sharded = [(r["model"], r["mode"], r["P"], tuple(r["dims"])) for r in records
               if r["P"] not in (1, None)]
    assert floors.keys() == {(*key, True) for key in sharded} | {
        (*key, "plus") for key in sharded if key[3] == (2,)}
    for floor in floors.values():
        assert "error" not in floor, floor["error"]
        assert floor["ranks"][0]["compute"] > 0, floor
    assert {(r["model"], r["mode"], r["P"], tuple(r["dims"])) for r in records} == {
        (m, mode, p, dims) for m in models for mode in modes
        for p, dims in ((1, ()), (2, (2,)), (2, (3,)))}
    for record in records:
        assert "error" not in record, record["error"]
        for row in record["ranks"]:
            assert row["act"] > 0 and row["compute"] > 0 and row["wall"] > 0, row
            assert row["rel"] <= REL_TOL[record["mode"]], record
            # one device moves nothing; two ranks exchange halos
            assert (row["sent"] > 0) == (record["P"] > 1), record
            # un-warmed (`--warmup 0`): a sharded call's first run agrees its sites
            assert (row["agreed"] > 0) == (record["P"] > 1 and not record.get("floor")), \
                record


@pytest.mark.gloo
def test_every_model_every_mode(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Decode, encode and a training step, all six models, P = 1 and 2 with T sharded and
    with H sharded (or the plan's refusal), diffusers' tiling beside (one pair of worlds:
    starting them dominates at this size)."""
    models, modes = sorted(vae.vae_models.MODELS), list(vae.MODES)
    out = tmp_path / "results.json"
    records = vae.main([*TINY, "--ranks", "2", "--dims", "2", "--dims", "3", "--approx",
                        "--floor", "--floor-plus", "--out", str(out)])
    _check(records, modes, models)
    hunyuan = next(r for r in records
                   if r["model"] == "hunyuan" and r["mode"] == "decode" and r["P"] == 1)
    approx = hunyuan["ranks"][0]["approx"]
    # tiling and temporal tiles change the result: that is what the exact runs avoid
    assert approx.keys() == {"tiled", "framewise"}
    assert all(row["max_abs"] > 0 and row["psnr"] < 100 for row in approx.values()), approx
    printed = capsys.readouterr().out
    for header in ("decode, T sharded:", "encode, H sharded:", "train, H sharded:",
                   "compute/floor | floor+*P/one | compute/floor+ |",
                   "decode, diffusers' approximations"):
        assert header in printed
    assert json.loads(out.read_text())["records"] == json.loads(json.dumps(records))


def test_refused_setting_gets_a_row(capsys: pytest.CaptureFixture[str]) -> None:
    """A model whose plan refuses the dims gets a `refused: <HaloError text>` row per mode,
    asked on the meta device: no world runs it (nor its reference, every setting
    refused)."""
    records = vae.main([*TINY, "--models", "cogvideox", "--modes", "decode", "encode",
                        "--ranks", "4", "--dims", "2", "3"])
    assert [(r["model"], r["mode"], r["P"], r["dims"]) for r in records] == [
        ("cogvideox", "decode", None, [2, 3]), ("cogvideox", "encode", None, [2, 3])]
    assert all("CogVideoX" in r["refused"] and "(2, 3)" in r["refused"] for r in records)
    assert "| cogvideox | - | refused: " in capsys.readouterr().out


@pytest.mark.gloo
def test_floor_alone_runs_each_share_on_one_device(capsys: pytest.CaptureFixture[str]) -> None:
    """`--floor-alone`: after the reference, one process runs one device's call on each
    rank's share of P, one share at a time: the same shares (frames and rows) as `--floor`
    runs at once on P processes, nothing sent; its columns in the table."""
    records = vae.main([*TINY, "--models", "hunyuan", "--modes", "decode", "train",
                        "--ranks", "2", "--dims", "3", "--floor", "--floor-alone"])
    for mode in ("decode", "train"):
        mine = [r for r in records if r["mode"] == mode]
        alone = sorted((r for r in mine if r.get("floor") == "alone"),
                       key=lambda r: r["rank"])
        floor = next(r for r in mine if r.get("floor") is True)
        assert [(r["P"], r["rank"], r["dims"]) for r in alone] == [(2, 0, [3]), (2, 1, [3])]
        for one, together in zip(alone, floor["ranks"], strict=True):
            assert "error" not in one, one["error"]
            (row,) = one["ranks"]
            assert row["compute"] > 0 and row["sent"] == 0, row
            assert (row["frames"], row["latent_frames"], row["latent_rows"]) == (
                together["frames"], together["latent_frames"], together["latent_rows"])
    printed = capsys.readouterr().out
    assert "compute/floor | alone*P/one | compute/alone |" in printed
    assert "(floor alone: one device's call on one rank's share) rank 1:" in printed


@pytest.mark.gloo
def test_paired_runs_one_device_beside_each_sharded_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--paired`: right after each sharded run, rank 0 of the same world runs one device's
    call on the whole input (the other ranks wait, nothing sent), and the next sharded run
    (every rank's model rebuilt) is still exact; its columns in the table."""
    records = vae.main([*TINY, "--models", "hunyuan", "--modes", "train", "decode",
                        "--ranks", "2", "--dims", "2", "--paired"])
    assert [(r["mode"], r["P"], r.get("floor")) for r in records] == [
        ("train", 1, None), ("decode", 1, None), ("train", 2, None), ("train", 2, "one"),
        ("decode", 2, None), ("decode", 2, "one")]
    for record in records:
        assert "error" not in record, record["error"]
        if record.get("floor") == "one":
            one = next(r for r in records if r["mode"] == record["mode"] and r["P"] == 1)
            (row,) = record["ranks"]  # rank 0's alone
            assert row["sent"] == 0 and row["compute"] > 0, row
            assert row["frames"] == one["ranks"][0]["frames"], (row, one)
        elif record["P"] == 2:
            assert all(row["rel"] <= REL_TOL[record["mode"]] for row in record["ranks"])
    assert "paired/one | compute*P/paired |" in capsys.readouterr().out


def test_repeats_keep_the_fastest_time_and_the_highest_peak() -> None:
    """`--repeat`: compute and wall from the fastest run, the peak (and where) from the
    highest."""
    a = {"compute": 2.0, "wall": 3.0, "act": 10, "where": "a", "largest": ["a"], "sent": 5}
    b = {"compute": 1.5, "wall": 3.5, "act": 12, "where": "b", "largest": ["b"], "sent": 5}
    assert vae._fastest(a, b) == {"compute": 1.5, "wall": 3.0, "act": 12, "where": "b",
                                  "largest": ["b"], "sent": 5, "reps": 2}
    assert vae._fastest(b, a)["act"] == 12 and vae._fastest(b, a)["where"] == "b"


def test_repeat_times_each_case_that_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--repeat 3` reaches every job, and a job's call is measured three times (the
    gradients zeroed between), the fastest kept."""
    args = vae._args([*TINY, "--ranks", "2", "--repeat", "3", "--floor"])
    assert {job["repeat"] for job in vae._jobs(args, "/tmp", 2, {})} == {3}
    times = iter([3.0, 1.0, 2.0])
    monkeypatch.setattr(vae, "_measure", lambda step, device, model, together: (
        step(), {"compute": next(times), "wall": 1.0, "act": 1, "where": "", "largest": []}))
    calls = {"run": 0, "zero": 0}

    class Run:
        device, vae, job = "cpu", None, {"name": "hunyuan"}

        def run(self) -> int:
            calls["run"] += 1
            return calls["run"]

        def zero_grads(self) -> None:
            calls["zero"] += 1

    out, row = vae._timed(Run(), 3)  # type: ignore[arg-type]
    assert out == 3 and row["compute"] == 1.0 and row["reps"] == 3, row
    assert calls == {"run": 3, "zero": 2}


def test_the_floor_one_frame_longer_adds_a_latent_frame_after_the_first_rank() -> None:
    """`--floor-plus`: a rank after the first on T runs one device's call on one latent
    frame more than it holds (`1 + k t` video frames, `k + 1` latents); the first rank,
    and H, as `--floor`."""
    video = torch.empty(1, 3, 1 + 4 * 15, 32, 32)  # HunyuanVideo: t = 4, 16 latent frames
    latent = torch.empty(1, 16, 16, 8, 8)
    for rank in range(4):  # 4 latent frames each: 13 video frames, 17 one frame longer
        assert vae._share(video, "hunyuan", "default", "train", [(2, 4, rank)]
                          ).shape[2] == 13
        assert vae._share(video, "hunyuan", "default", "train", [(2, 4, rank)], plus=True
                          ).shape[2] == (17 if rank else 13)
        assert vae._share(latent, "hunyuan", "default", "decode", [(2, 4, rank)], plus=True
                          ).shape[2] == (5 if rank else 4)
    assert vae._share(video, "hunyuan", "default", "train", [(3, 2, 1)], plus=True
                      ).shape == (1, 3, 61, 16, 32)
    args = vae._args([*TINY, "--ranks", "2", "--dims", "2", "--dims", "3", "--floor-plus"])
    assert [(job["dims"], job.get("floor")) for job in vae._jobs(args, "/tmp", 2, {})
            if job["name"] == "wan" and job["mode"] == "train"] == [
        ((2,), None), ((3,), None), ((2,), "plus")]


@pytest.mark.parametrize("coords", [[(2, 2, 1)], [(3, 3, 2)], [(2, 2, 0), (3, 2, 1)]])
def test_upstream_is_a_shard_of_one_tensor(coords: list[tuple[int, int, int]]) -> None:
    """Each rank draws its shard of the upstream gradient on its own: on T, H or both it
    is the rank's chunk of the tensor one device draws (so the training step's gradients
    compare with one device's)."""
    shape = torch.Size((1, 3, 5, 7, 4))
    whole = vae._upstream(torch.empty(shape), shape, [])
    mine = vae._shard_of(whole, coords)
    assert torch.equal(vae._upstream(torch.empty(mine.shape), shape, coords), mine)


def test_peak_uncounts_a_reused_address() -> None:
    """The profiler misses frees made on other threads (gloo's worker dropping a halo
    move's buffers): an allocation at an address still counted live uncounts the buffer
    that was there, so the peak is one buffer, not two; a buffer allocated before the
    block and freed in it lowers the count by its size."""
    from types import SimpleNamespace

    from torch._C._profiler import _EventType

    def alloc(t: int, size: int, ptr: int) -> Any:
        return SimpleNamespace(tag=_EventType.Allocation, start_time_ns=t, children=[],
                               extra_fields=SimpleNamespace(alloc_size=size, ptr=ptr),
                               parent=None, name="[memory]")

    def peak(*events: Any) -> int:
        results = SimpleNamespace(experimental_event_tree=lambda: list(events))
        prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=results))
        return vae._profiled_peak(prof)[0]

    # 100 bytes at address 1, freed unseen, then 100 bytes at address 1 again
    assert peak(alloc(1, 100, 1), alloc(2, 100, 1)) == 100
    assert peak(alloc(1, 100, 1), alloc(2, 100, 2)) == 200  # two live buffers
    # a buffer from before the block freed (50), then 120 allocated: 70 above the start
    assert peak(alloc(1, -50, 9), alloc(2, 120, 3)) == 70
    assert peak(alloc(1, 100, 1), alloc(2, -100, 1), alloc(3, 40, 1)) == 100


def counted(size: int) -> dict[str, float]:
    """On each rank: bytes_sent of one all-to-all of `size` float32 rows per peer, and
    peak_bytes of one allocation of 1 MiB."""
    world = dist.get_world_size()
    buf = torch.zeros(size * world)
    with vae.bytes_sent() as sent:
        dist.all_to_all_single(torch.empty_like(buf), buf)
        dist.all_gather_single(torch.empty(size * world), torch.zeros(size))
        # DTensor's own gathers: funcol's all_gather_tensor calls all_gather_single
        funcol.all_gather_tensor(torch.zeros(size), 0, dist.group.WORLD).wait()
    with vae.peak_bytes("cpu") as peak:
        torch.ones(2**18).sum()  # float32: 1 MiB, freed at once
    return {"sent": sent["bytes"], "peak": peak["peak"]}


@pytest.mark.gloo
def test_counters(gloo: Callable[[int], GlooWorld]) -> None:
    """An all-to-all sends its rows to the other P - 1 ranks, an all-gather its input to
    them (a functional one counted once); the peak counts a transient 1 MiB buffer (its
    sum's scalar output beside it)."""
    for row in gloo(2).run(counted, 1000):
        assert row["sent"] == 3 * 1000 * 4, row
        assert 2**20 <= row["peak"] <= 2**20 + 1024, row
