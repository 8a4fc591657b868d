"""A parallel model's worker as torchrun's ranks (``parallelType`` pp, tp or pptp).

TorchServe starts such a worker as ``torchrun --nproc-per-node N``: N processes, each with
torchrun's environment (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ...), its frontend connected to every one of them; each rank loads the
handler, and each batch goes to every rank (tp, pptp) or to rank 0 alone (pp), rank 0 alone
answering. mserve starts the N ranks itself, each like any worker (forked from its model's
warm template, confined by the sandbox, on a channel of its own) and with the environment
torchrun gives them, rather than through torchrun's agent: the agent closes the file
descriptors its ranks would inherit (the channel), starts N interpreters that each import
torch again, and restarts ranks on its own, where the server restarts the whole group.
``server/workers/process.py`` runs the group; this module says what each rank gets.
"""

from __future__ import annotations

import os
import socket

from server.config.model_settings import Parallel

MASTER_ADDR = "127.0.0.1"  # the ranks rendezvous on this machine (nnodes 1)


def free_port() -> int:
    """A TCP port nobody listens on now, for the rendezvous: rank 0's ``init_process_group``
    serves its store there. The kernel picks it from its ephemeral range, which the sandbox
    opens to the ranks (server/workers/sandbox.py, ``peer_port_ranges``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((MASTER_ADDR, 0))
        return int(sock.getsockname()[1])


def rank_env(parallel: Parallel, rank: int, master_port: int, run_id: str) -> dict[str, str]:
    """What torchrun (``torch.distributed.run``, one node) puts in rank ``rank``'s
    environment, and what TorchServe adds: ``OMP_NUM_THREADS`` from the torchrun section's
    ``OMP_NUMBER_THREADS`` (1 unless set) and ``LOGLEVEL``. The ranks' own store: rank 0
    serves it at ``MASTER_PORT`` (there is no torchrun agent to serve one)."""
    world = str(parallel.ranks)
    env = {
        "LOCAL_RANK": str(rank),
        "RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": world,
        "WORLD_SIZE": world,
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": world,
        "MASTER_ADDR": MASTER_ADDR,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "OMP_NUM_THREADS": str(parallel.omp_threads),
        "LOGLEVEL": "INFO",
    }
    if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ:  # torchrun's default, else the
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"  # server's own value passes through
    return env


def rank_envs(parallel: Parallel, model: str, worker_id: str) -> list[dict[str, str]]:
    """Each rank's environment, rank 0 first, on a rendezvous port drawn now: a group started
    again (a rank died) rendezvous afresh, as a new torchrun would."""
    port = free_port()
    run_id = f"{model}_{worker_id}"  # TorchServe's rdzv-id: the model and its worker's port
    return [rank_env(parallel, rank, port, run_id) for rank in range(parallel.ranks)]
