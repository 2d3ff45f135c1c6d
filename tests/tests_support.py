"""Small helpers shared by tests that launch subprocesses."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun_results(script: str, out_dir: Path, *args: str, timeout: int = 300) -> dict:
    """Run tests/<script> under `torchrun --nproc_per_node=2` (gloo, 1 thread per rank) and return the
    results.json it wrote into out_dir. One launch per test module: each costs 10-20 s."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
               str(ROOT / "tests" / script), str(out_dir), *args]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    finished = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout)
    assert finished.returncode == 0, \
        f"torchrun failed ({finished.returncode}):\n{finished.stdout[-4000:]}\n{finished.stderr[-8000:]}"
    return json.loads((Path(out_dir) / "results.json").read_text())
