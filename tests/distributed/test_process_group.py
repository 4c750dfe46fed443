"""Which backends a run's process group gets (`choose_backend`), rehearsed on CPU against NCCL's rule
that a collective on a CPU tensor fails ("No backend type associated with device type cpu"): gloo
registered for the CUDA device type only stands in for NCCL, so torch's own dispatch refuses CPU
tensors exactly as it does on a GPU run. The case that needs it: FSDP2 with ``cpu_offload``, whose
gradients are DTensors on the CPU and whose gradient clipping all-reduces their norm."""

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tts_lightning.distributed.processes import choose_backend

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_backend_choice():
    assert choose_backend(CPU, cpu_offload=False) == "gloo"
    assert choose_backend(CUDA, cpu_offload=False) == "nccl"
    assert choose_backend(CUDA, cpu_offload=True) == "cpu:gloo,cuda:nccl"
    assert choose_backend(CUDA, cpu_offload=True, requested="nccl") == "nccl"  # the user's word stands


def stand_in(backend: str) -> str:
    """``backend`` on a CPU-only machine: each device type keeps its registration, NCCL's taken by gloo."""
    if ":" not in backend:
        backend = {"nccl": "cuda:nccl", "gloo": "cpu:gloo"}[backend]
    return backend.replace("nccl", "gloo")


def _clip_offloaded_gradients(rank, backend, store, results):
    """One rank of 2: CPU DTensor gradients (FSDP2 under cpu_offload) clipped by torch's
    clip_grad_norm_, as Lightning clips them, over a process group with ``backend``'s registrations."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    dist.init_process_group(backend, store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        local = torch.full((4, 4), float(rank + 1))
        param = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
        param.grad = DTensor.from_local(local * 10, mesh, [Shard(0)], run_check=False)
        try:
            norm = torch.nn.utils.clip_grad_norm_([param], 1.0)
            results[rank] = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        except RuntimeError as exc:
            results[rank] = str(exc)
    finally:
        dist.destroy_process_group()


def _clip(backend: str) -> list:
    with tempfile.NamedTemporaryFile() as store, mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            _clip_offloaded_gradients, args=(backend, store.name, results), nprocs=2, start_method="fork"
        )
        return [results[0], results[1]]


@pytest.mark.slow  # two forked ranks
def test_offloaded_gradient_clipping_needs_a_cpu_backend_beside_nccl():
    expected = 10 * (16 * 1**2 + 16 * 2**2) ** 0.5  # the norm over both ranks' shards
    chosen = _clip(stand_in(choose_backend(CUDA, cpu_offload=True)))
    assert chosen == pytest.approx([expected, expected])
    # The rehearsal can fail: NCCL alone (the choice before) refuses the CPU norm on every rank.
    nccl_only = _clip(stand_in(choose_backend(CUDA, cpu_offload=False)))
    assert all("No backend type associated with device type cpu" in str(r) for r in nccl_only), nccl_only


def _gather_host_objects(rank, backend, store, results):
    """One rank of 2: its optimizer state (a host object) gathered on rank 0 as a full checkpoint
    gathers the quantized optimizers' per-rank state; then again in a default group made after the
    first was destroyed (a fit after another in the same processes), which needs its own gloo group."""
    from tts_lightning.distributed import rank_local_state

    torch.set_num_threads(1)
    gathered = []
    for attempt in range(2):
        dist.init_process_group(backend, store=dist.FileStore(f"{store}{attempt}", 2), rank=rank, world_size=2)
        try:
            group = rank_local_state.host_group()  # made at setup (`prepare_full_saves`), then reused
            value = {"rank": rank, "codes": torch.full((3,), rank + attempt)}
            result = rank_local_state.gather_on_rank0(value, rank, 2)
            assert group is not None and rank_local_state.host_group() is group
            assert len(rank_local_state._HOST_GROUPS) == 1, "a destroyed default group's gloo group was kept"
            gathered.append(result)
        except Exception as exc:  # reported to the test, which says what failed
            gathered.append(f"{type(exc).__name__}: {exc}")
        finally:
            dist.destroy_process_group()
    results[rank] = gathered


@pytest.mark.slow  # two forked ranks
def test_host_objects_are_gathered_over_a_cpu_group_beside_nccl(tmp_path):
    """`rank_local_state.gather_on_rank0` under NCCL alone (its stand-in: gloo registered for the CUDA
    device type only, where torch's object collectives stage the objects on the GPU: "Found no
    NVIDIA driver" here before): a gloo group gathers them in host memory, one per default group."""
    with mp.Manager() as manager:
        results = manager.dict()
        backend = stand_in(choose_backend(CUDA, cpu_offload=False))
        store = str(tmp_path / "store")
        mp.start_processes(_gather_host_objects, args=(backend, store, results), nprocs=2, start_method="fork")
        on_rank0, elsewhere = results[0], results[1]
    assert elsewhere == [None, None], elsewhere
    for attempt, gathered in enumerate(on_rank0):
        assert isinstance(gathered, list), gathered
        assert [g["rank"] for g in gathered] == [0, 1], gathered
        assert [g["codes"].tolist() for g in gathered] == [[attempt] * 3, [1 + attempt] * 3]


def _reduce_in_step(rank, store, results):
    """One rank of 2 in a group Lightning keeps: both reduce at the group's world size, then rank 0
    alone runs a one-device step (world size 1), which must not reduce over the group (a hang)."""
    from datetime import timedelta

    from tts_lightning.distributed.step_collectives import all_reduce_in_step

    dist.init_process_group(
        "gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2, timeout=timedelta(seconds=20)
    )
    try:
        both = all_reduce_in_step(torch.tensor([rank + 1.0, 4.0 * rank]), "mean", 2).tolist()
        alone = all_reduce_in_step(torch.tensor([rank + 1.0]), "sum", 1).tolist() if rank == 0 else None
        results[rank] = (both, alone)
    except Exception as exc:  # a timeout: rank 0 waited for a reduction rank 1 never joined
        results[rank] = f"{type(exc).__name__}: {exc}"
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow  # two forked ranks
def test_step_reductions_follow_the_trainers_world_size(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_reduce_in_step, args=(str(tmp_path / "store"), results), nprocs=2, start_method="fork")
        got = dict(results)
    assert got == {0: ([1.5, 2.0], [1.0]), 1: ([1.5, 2.0], None)}, got


def test_ray_gpu_workers_get_the_cpus_of_their_gpu_under_cpu_offload():
    """ray-fit's default CPUs per worker: AdamW steps on the CPU under cpu_offload, so a GPU worker
    asks for its share of the node's CPUs (Ray sets its OMP_NUM_THREADS to that), not one."""
    from tts_lightning.distributed.ray import worker_cpus

    cluster = {"CPU": 64.0, "GPU": 8.0}
    assert worker_cpus(cluster, use_gpu=True, cpu_offload=True) == 8
    assert worker_cpus(cluster, use_gpu=True, cpu_offload=False) == 1
    assert worker_cpus({"CPU": 2.0}, use_gpu=False, cpu_offload=False) == 1
