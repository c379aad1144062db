"""`trainapp doctor --comm`: its judgement on its own, and a real run across three network namespaces
on one bridge, one host's link rate-limited by a real `tbf` qdisc."""

from __future__ import annotations

import netns
import pytest
from helpers import TORCHRUN
from test_net import _PORTS, _wait, needs_netns, procs  # noqa: F401  (procs: the fixture)

from trainapp.launch.comm import Pair, judge


def test_comm_names_the_slow_host_among_three_and_a_slow_path_among_four():
    mib = 2**20

    def pairs(bw: dict) -> list[Pair]:
        return [Pair(a, b, mib / (gbps * 1e9), mib) for (a, b), gbps in bw.items()]

    # host c behind a slow link: two of the three pairs are slow, and c is named, not the pairs.
    lines, problems = judge(["a", "b", "c"], pairs({("a", "b"): 1.0, ("a", "c"): 0.005, ("b", "c"): 0.005}),
                            0)
    assert (len(problems) == 1
            and problems[0].startswith("host c: its pairs reach a median 0.005 GB/s")), problems
    assert "SLOW" not in lines[0] and "SLOW" in lines[1] and "SLOW" in lines[2]
    # one bad path between a and b of four healthy hosts: the pair is named, no host.
    four = {(x, y): 1.0 for x, y in [("a", "b"), ("a", "c"), ("a", "d"), ("b", "c"), ("b", "d"), ("c", "d")]}
    lines, problems = judge(list("abcd"), pairs({**four, ("a", "b"): 0.1}), 0)
    assert problems == ["pair a <-> b: 0.100 GB/s; check the path between them"], problems
    # all even: nothing; two nodes: only --min-bandwidth can judge.
    assert judge(list("abcd"), pairs(four), 0)[1] == []
    assert judge(["a", "b"], pairs({("a", "b"): 0.1}), 0)[1] == []
    assert judge(["a", "b"], pairs({("a", "b"): 0.1}), 0.5)[1] == [
        "pair a <-> b: 0.100 GB/s; check the path between them"]


@pytest.mark.e2e
@needs_netns
@pytest.mark.slow
def test_doctor_comm_names_the_host_whose_link_is_rate_limited(procs, tmp_path):  # noqa: F811
    star = netns.Star(3).up()
    try:
        def doctor(tag: str) -> tuple[list[int], str]:
            port = next(_PORTS)
            ps = [procs.start(h, [TORCHRUN, "--nnodes=3", f"--node-rank={i}", "--nproc-per-node=1",
                                  f"--master-addr={star.hosts[0].train_ip}", f"--master-port={port}", "-m",
                                  "trainapp", "doctor", "--comm", "--size-mb=4", "--iters=5",
                                  "network.interface=trn0"],
                              tmp_path / f"{tag}-{h.hostname}.log") for i, h in enumerate(star.hosts)]
            codes = _wait(ps, 240)
            return codes, (tmp_path / f"{tag}-host-a.log").read_text(errors="replace")

        codes, out = doctor("even")
        assert codes == [0, 0, 0], out[-3000:]
        assert "doctor --comm: no problems (3 node pair(s))" in out
        assert "comm  gloo across 3 node(s) (host-a, host-b, host-c)" in out and "trn0" in out

        # 1 MiB all-reduces vary 4x here (three processes on two cores); 4 MiB ones within 20%.
        star.shape(2, "100mbit")  # host-c: 12.5 MB/s each way, against the veths' 0.5-0.8 GB/s
        codes, out = doctor("shaped")
        assert codes == [1, 1, 1], out[-3000:]
        fails = [line for line in out.splitlines() if line.startswith("FAIL  comm")]
        assert (len(fails) == 1
                and fails[0].startswith("FAIL  comm  host host-c: its pairs reach a median")), out[-3000:]
        pair_ab = next(line for line in out.splitlines() if line.startswith("pair  host-a <-> host-b"))
        assert "SLOW" not in pair_ab, out[-3000:]
        slow_c = [line for line in out.splitlines() if line.startswith("pair") and "host-c" in line]
        assert (len(slow_c) == 2
                and all("SLOW" in line and float(line.split()[4]) < 0.02 for line in slow_c)), slow_c
    finally:
        procs.kill()
        star.down()
