"""Non-blocking point-to-point (the tutorial's ``isend``/``irecv`` program),
as an exchange between every pair of ranks.

    mpirun -n 4 python -m hpccomm.examples.p2p_nonblocking

Each rank posts ``dist.isend`` of a tensor holding its rank to every other
rank and ``dist.irecv`` from every other rank, all before waiting on any:
nonblocking operations return at once, so the order in which ranks post
them cannot deadlock.  A tensor being sent must not be written, and one
being received must not be read, until its request's ``wait()`` returns.
At 1 rank there are no peers: nothing is exchanged.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._common import Checks, each, run, say, start


def main() -> int:
    rank, size = start()
    checks = Checks()
    peers = [r for r in range(size) if r != rank]
    mine = torch.full((3,), float(rank))
    inbox = {r: torch.empty(3) for r in peers}
    requests = []
    for r in peers:
        requests.append(dist.isend(mine, dst=r))
        requests.append(dist.irecv(inbox[r], src=r))
    say(f"rank 0 posted {len(requests)} requests; waiting")
    for req in requests:
        req.wait()
    for r in peers:
        checks.expect(torch.equal(inbox[r], torch.full((3,), float(r))),
                      f"from rank {r}: got {inbox[r].tolist()}, expected {[float(r)] * 3}")
    each(f"received {[inbox[r][0].item() for r in peers]} from ranks {peers}" if peers
         else "alone: no peers to exchange with")
    return checks.finish("p2p_nonblocking")


if __name__ == "__main__":
    run(main)
