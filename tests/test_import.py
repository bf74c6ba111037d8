"""`import haloshard` changes nothing in torch for a program that never builds a `HaloShard`.

Run in a fresh interpreter (other tests install the DTensor guards in this one): torch's
DTensor redistribute, to_local, custom op handlers and sharding-propagation slow path are the
very objects torch had before the import, and a `Shard(0)` matmul, a `Replicate`
redistribute and `ColwiseParallel`/`RowwiseParallel` give identical results with and without
it. The first `HaloShard` built installs the guards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    dispatcher = DTensor._op_dispatcher

    def torch_state():
        return (DTensor.redistribute, DTensor.to_local, dict(dispatcher._custom_op_handlers),
                dispatcher._propagate_op_sharding_dispatch_slow_path)

    def results():
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(4, 3, generator=g), torch.randn(3, 5, generator=g)
        mm = (distribute_tensor(a, mesh, [Shard(0)]) @ distribute_tensor(b, mesh, [Replicate()]))
        rep = distribute_tensor(a, mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Linear(8, 3))
        parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        out = mlp(a)
        out.sum().backward()
        return [mm.full_tensor(), rep.to_local(), out, mlp[0].weight.grad.full_tensor()]

    before, expected = torch_state(), results()
    import haloshard
    after = torch_state()
    assert after[0] is before[0] and after[1] is before[1] and after[3] == before[3], after
    assert after[2] == before[2], "custom op handlers changed"
    for got, want in zip(results(), expected, strict=True):
        assert torch.equal(got, want), (got, want)
    assert torch_state()[2] == before[2]
    haloshard.HaloShard(2, left=1)  # the first HaloShard installs the guards
    assert DTensor.redistribute is not before[0]
    dist.destroy_process_group()
    print("unchanged")
''')


def test_import_changes_nothing_in_torch() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0 and "unchanged" in done.stdout, done.stderr[-3000:]


def test_import_needs_only_torch_and_einops(tmp_path) -> None:
    """A venv with only the declared dependencies has no numpy (torch does not require it): a
    stand-in `numpy` package that fails to import, first on the path, plays that venv. Nothing
    `import haloshard` pulls in may need numpy (torch's `tensor.debug` did)."""
    fake = tmp_path / "numpy"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'numpy\' (hidden)", name="numpy")\n')
    code = ("import sys, haloshard\n"
            "assert 'numpy' not in sys.modules or sys.modules['numpy'] is None\n"
            "print(haloshard.__name__)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False, env=env)
    assert done.returncode == 0 and "haloshard" in done.stdout, done.stderr[-3000:]
