"""A job that declares two nodes on one machine: the lowering of each group follows the node layout.

Two launchers, ``tilescale run --nnodes 2 --node-rank 0|1 -n 2 --cpu``, on this machine
make one job of 4 CPU-path ranks on two declared nodes (``tests/ranks/two_nodes.py``): its
intra-node TP groups get peer addresses, its cross-node DP and EP groups NVSHMEM device
calls (checked in the CUDA generated for their kernels), and every op on every group still
matches gloo, the cross-node ones interpreted through the device-call protocol.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid

import pytest
from cpu_jobs import ROOT, clean_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(400)
def test_groups_inside_a_node_use_addresses_and_groups_across_nodes_use_device_calls():
    port, job = str(_free_port()), f"two-nodes-{uuid.uuid4().hex[:8]}"
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "tilescale.launch", "run", "--nnodes", "2", "--node-rank", str(node), "-n", "2",
             "--cpu", "--master-addr", "127.0.0.1", "--master-port", port, "--job-id", job,
             "tests/ranks/two_nodes.py"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
        for node in (0, 1)
    ]
    outputs = [p.communicate(timeout=380) for p in launchers]
    report = "\n".join(f"--- node {n} exit {p.returncode}\n{out[-5000:]}\n{err[-5000:]}"
                       for n, (p, (out, err)) in enumerate(zip(launchers, outputs, strict=True)))
    assert all(p.returncode == 0 for p in launchers), report
    stdout = "".join(out for out, _ in outputs)
    for rank in range(4):
        assert f"TWO-NODES-OK rank={rank}" in stdout, report
    assert "CUDA of the TP kernel has peer stores, of the DP kernel NVSHMEM calls" in stdout, report
