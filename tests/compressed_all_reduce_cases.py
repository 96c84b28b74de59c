"""What the tests of recxla's compressed dense all-reduces (FP8AllReduce, PowerSGDAllReduce)
share: gradients, parameters, every node layout of 4 ranks, a stand-in for DDP's bucket, and
the check that the buckets' grouping and a save/load of the state change no bit."""

import torch


def grads_of(seed, rank, step, shapes):
    g = torch.Generator().manual_seed(seed * 1009 + rank * 31 + step)
    # Magnitudes that differ per parameter and per rank, as gradients do.
    return [torch.randn(s, generator=g) * float(torch.rand(1, generator=g) * 10 + 0.01)
            for s in shapes]


def params_of(shapes):
    return [torch.nn.Parameter(torch.zeros(s)) for s in shapes]


def node_layouts(world):
    """(label, node-group kwargs of a compressed all-reduce) of every layout on `world` ranks,
    groups created by every rank in the same order."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = [("flat", {})]
    for per_node in (2, 1, 4):
        nodes = world // per_node
        mine = {}
        for ranks in [list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)]:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine["node_group"] = group
        for ranks in [[n * per_node + i for n in range(nodes)] for i in range(per_node)]:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine["cross_group"] = group
        out.append((f"{nodes}x{per_node}", mine))
    return out


class Bucket:
    """What a DDP comm hook reads of a bucket. flat: the gradients are views of the bucket's
    buffer, one after another (DDP's layout; the averages land in the buffer); else the
    gradients are the tensors given (written in place) and the buffer a copy of them."""

    def __init__(self, params, grads, last, flat=False):
        self._params, self._last = params, last
        self._buffer = torch.cat([g.flatten() for g in grads])
        if flat:
            starts = [0]
            for g in grads:
                starts.append(starts[-1] + g.numel())
            grads = [self._buffer[a:b].view_as(g) for a, b, g in zip(starts, starts[1:], grads)]
        self._grads = grads
        self.gradient_reads = 0  # calls of gradients()

    def parameters(self):
        return self._params

    def gradients(self):
        self.gradient_reads += 1
        return self._grads

    def buffer(self):
        return self._buffer

    def is_last(self):
        return self._last


def ddp_training_body(rank, world, seed, steps, hook=None, kwargs=None):
    """A small regression trained with DDP over several buckets, averaged by DDP's own
    all-reduce (hook None) or by a hook of recxla.distributed, (state class name, hook
    function name), the state made by for_ddp(ddp, **kwargs): {"weights", "same_on_ranks",
    "loss" (the last step's)}."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import recxla.distributed

    torch.manual_seed(seed)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002)  # several buckets
    if hook is not None:
        cls_name, hook_name = hook
        ddp.register_comm_hook(getattr(recxla.distributed, cls_name).for_ddp(ddp, **kwargs),
                               getattr(recxla.distributed, hook_name))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed * 7 + rank)
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(seed))
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), x @ w)
        opt.zero_grad()
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    return {"weights": flat, "same_on_ranks": all(torch.equal(t, flat) for t in gathered),
            "loss": loss.item()}


def error_messages(calls):
    """The ValueError message of each of `calls` (callables that must raise it)."""
    import pytest

    messages = []
    for call in calls:
        with pytest.raises(ValueError) as e:
            call()
        messages.append(str(e.value))
    return messages


def regroup_and_resume_body(rank, world, cls_name, kwargs, seed, shapes, steps, split):
    """`steps` averages with every parameter in one bucket, with the buckets of `split`, and
    with those buckets and a new state loaded from the old one's state_dict() halfway (a
    resumed run): {"regrouped": same bits, "resumed": same bits, "changes": the averages
    moved}."""
    import recxla.distributed

    cls = getattr(recxla.distributed, cls_name)

    def run(buckets, resume_at=None, flat=False):
        params = params_of(shapes)
        named = [(f"p{i}", p) for i, p in enumerate(params)]
        sync = cls(named, **kwargs)
        results, reads = [], []
        for step in range(steps):
            if step == resume_at:  # a new state from the saved one, as a resumed run
                saved = {k: v.clone() for k, v in sync.state_dict().items()}
                sync = cls(named, **kwargs)
                sync.load_state_dict(saved)
            grads = grads_of(seed, rank, step, shapes)
            made = [Bucket([params[i] for i in b], [grads[i] for i in b],
                           k + 1 == len(buckets), flat) for k, b in enumerate(buckets)]
            handles = [sync.start_bucket(bucket) for bucket in made]
            sync.finish([h for h in handles if h is not None])
            reads.append(sum(bucket.gradient_reads for bucket in made))
            averaged = {i: g for b, bucket in zip(buckets, made)
                        for i, g in zip(b, bucket.gradients())}
            results.append(torch.cat([averaged[i].flatten() for i in range(len(shapes))]))
        return torch.stack(results), reads

    # The whole set in one flat bucket (DDP's layout) against split buckets of separate
    # gradients and of flat buffers: the same bits whatever holds the gradients.
    whole, reads = run([list(range(len(shapes)))], flat=True)
    return {"regrouped": torch.equal(whole, run(split)[0]) and
            torch.equal(whole, run(split, flat=True)[0]),
            "resumed": torch.equal(whole, run(split, resume_at=steps // 2)[0]),
            "changes": not torch.equal(whole[0], whole[-1]),
            # the all-reduce's gradients() calls per step on the flat whole set
            "gradient_reads": reads}
