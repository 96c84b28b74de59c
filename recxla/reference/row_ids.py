"""Reference of the sender's row-exchange encoding (see recxla.ops.row_ids for the contract):
plain Python over the ids, one id at a time.

The oracle of tests/test_row_ids.py for the C++ kernel (csrc/cpu/row_ids.cpp) and the op's
torch path (recxla.ops.row_ids.encode_row_ids_torch): a different computation from both,
written for clarity, not speed.
"""

import torch

from recxla.ops.row_ids import EncodedRows


def encode_row_ids_ref(group, slot, sample, ids, weights, slot_position, group_features,
                       micro) -> EncodedRows:
    """Same arguments and result as `recxla.ops.row_ids.encode_row_ids` (CPU tensors)."""
    groups, num_micro = len(group_features), len(micro)
    micro_of = [k for k, size in enumerate(micro) for _ in range(size)]
    group, slot, sample, ids = (t.tolist() for t in (group, slot, sample, ids))
    weights = None if weights is None else weights.tolist()
    n = len(ids)
    key = [(group[i], micro_of[sample[i]], slot_position[slot[i]], sample[i], i)
           for i in range(n)]
    order = sorted(range(n), key=lambda i: key[i])
    runs = {(g, k): [] for g in range(groups) for k in range(num_micro)}
    for i in order:
        runs[(group[i], micro_of[sample[i]])].append(i)
    unique, counts, bounds, inverse, distinct = [], [], [0], [], {}
    for g in range(groups):
        for k in range(num_micro):
            members = runs[(g, k)]
            distinct[(g, k)] = sorted({ids[i] for i in members})
            unique += distinct[(g, k)]
            counts.append(len(distinct[(g, k)]))
            bounds.append(bounds[-1] + len(members))
            inverse += [distinct[(g, k)].index(ids[i]) for i in members]
    plan, message_weights = [], []
    for k in range(num_micro):
        sizes = [len(distinct[(g, k)]) for g in range(groups)]
        for size in sizes:
            plan += list(range(size))
        first_row = [sum(sizes[:g]) for g in range(groups + 1)]
        plan += first_row
        for g in range(groups):
            for i in runs[(g, k)]:
                plan.append(first_row[g] + distinct[(g, k)].index(ids[i]))
                if weights is not None:
                    message_weights.append(weights[i])
        samples = [b for b, m in enumerate(micro_of) if m == k]
        end = 0
        plan.append(end)
        for g in range(groups):
            for f in range(group_features[g]):
                for b in samples:
                    end += sum(1 for i in runs[(g, k)]
                               if slot_position[slot[i]] == f and sample[i] == b)
                    plan.append(end)
    long = dict(dtype=torch.int64)
    return EncodedRows(
        torch.tensor(order, **long), torch.tensor(unique, **long),
        torch.tensor(counts, **long).view(groups, num_micro), torch.tensor(bounds, **long),
        torch.tensor(inverse, **long), torch.tensor(plan, **long),
        None if weights is None else torch.tensor(message_weights, dtype=torch.float32))


def expand_row_plan_ref(order, inverse, counts, bounds, slot, sample, input_lengths,
                        routes_per_slot, micro, group_chunks, group_first_chunk,
                        chunks_per_row) -> torch.Tensor:
    """Same arguments and result as `recxla.ops.row_ids.expand_row_plan` (CPU tensors): walks
    each micro-batch's output row by row (slot by slot, sample by sample, in bag order) and
    fills each row's chunks from the routes of its id."""
    order, inverse, slot, sample = (t.tolist() for t in (order, inverse, slot, sample))
    counts, bounds, lengths = counts.tolist(), bounds.tolist(), input_lengths.tolist()
    groups, num_micro = len(group_chunks), len(micro)
    micro_of = [k for k, size in enumerate(micro) for _ in range(size)]
    # Each route's (input index) row group, micro-batch and index into its run's distinct ids.
    run_of_route = {}
    for g in range(groups):
        for k in range(num_micro):
            r = g * num_micro + k
            for j in range(bounds[r], bounds[r + 1]):
                run_of_route[order[j]] = (g, k, inverse[j])
    plan = []
    for k in range(num_micro):
        sizes = [counts[g][k] * group_chunks[g] for g in range(groups)]
        row_base = [sum(sizes[:g]) for g in range(groups)]
        index, route = [], 0
        for s, slot_lengths in enumerate(lengths):
            for b, length in enumerate(slot_lengths):
                for _ in range(length):
                    routes = range(route, route + routes_per_slot[s])
                    route += routes_per_slot[s]
                    if micro_of[b] != k:
                        continue
                    row = [None] * chunks_per_row
                    for i in routes:
                        g, run_k, u = run_of_route[i]
                        assert run_k == k and slot[i] == s and sample[i] == b
                        for c in range(group_chunks[g]):
                            assert row[group_first_chunk[g] + c] is None
                            row[group_first_chunk[g] + c] = row_base[g] + u * group_chunks[g] + c
                    assert None not in row
                    index += row
        wire_rows = sum(sizes)
        plan += list(range(wire_rows)) + [0, wire_rows] + index + list(range(len(index) + 1))
    return torch.tensor(plan, dtype=torch.int64)
