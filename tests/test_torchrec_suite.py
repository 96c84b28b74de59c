"""TorchRec's own tests with recxla swapped in, each beside TorchRec's own pieces as the control
(docs/torchrec-suite.md).

1. The model-parallel, state-dict and sparse-only tests of the torchrec wheel's harness
   (tests/torchrec_suite_cases.py: the cases, the swaps, and NOT_APPLICABLE, the one list of
   TorchRec tests that cannot apply to recxla, with the reason). Every case runs once, in one pair
   of gloo ranks, the first time any of them is asked for; each is then its own test here.
2. TorchRec's EmbeddingBagCollectionTest (torchrec/modules/tests/test_embedding_modules.py in
   TorchRec's repository: not in the wheel), its checks on recxla.nn.EmbeddingBagCollection and,
   as the control, on TorchRec's module, with the outputs compared between the two.
The count of TorchRec tests run is printed at the end of the session.
"""

from functools import partial

import pytest
import torch

from distributed_utils import run_distributed
import torchrec_suite_cases as suite

torchrec = pytest.importorskip("torchrec")
from torchrec.fx import symbolic_trace  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

import recxla.nn  # noqa: E402

CASES = {case.id: case for case in suite.cases()}
RUN_TIMEOUT_S = 900


class _Counts:
    """Counts the runs of TorchRec's tests in this module (by what was swapped in) and prints
    them in pytest's closing summary."""

    def __init__(self):
        self.outcomes = {}  # test node id -> (variant, passed)

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.rsplit("::", 1)[-1]
        if report.when != "call" or not name.startswith(("test_torchrec_case[", "test_ebc_")):
            return
        param = name[name.index("[") + 1 : -1]
        variant = CASES[param].variant if param in CASES else param
        self.outcomes[report.nodeid] = (variant, report.passed)

    def pytest_terminal_summary(self, terminalreporter):
        if not self.outcomes:
            return
        by_variant = {}
        for variant, passed in self.outcomes.values():
            by_variant.setdefault(variant, []).append(passed)
        parts = ", ".join(f"{v}: {sum(ok)}/{len(ok)} passed" for v, ok in sorted(
            by_variant.items()))
        terminalreporter.write_line(
            f"TorchRec suite: {len(self.outcomes)} runs of TorchRec's tests ({parts}); "
            f"{len(suite.NOT_APPLICABLE)} entries not applicable, with reasons, in "
            "tests/torchrec_suite_cases.py NOT_APPLICABLE")


@pytest.fixture(scope="session", autouse=True)
def counts(request):
    plugin = _Counts()
    if not request.config.pluginmanager.has_plugin("recxla-torchrec-suite-counts"):
        request.config.pluginmanager.register(plugin, "recxla-torchrec-suite-counts")
    return request.config.pluginmanager.get_plugin("recxla-torchrec-suite-counts")


@pytest.fixture(scope="module")
def suite_results(request):
    """{case id: (outcome, message, seconds)} of the selected cases, from one run on 2 ranks."""
    selected = sorted({item.callspec.params["case_id"] for item in request.session.items
                       if getattr(item, "originalname", "") == "test_torchrec_case"})
    per_rank = run_distributed(suite.run_cases, 2, args=(selected,), timeout=RUN_TIMEOUT_S,
                               group_timeout=suite.CASE_TIMEOUT_S + 120)
    merged = {}
    for results in per_rank:
        for case_id, (outcome, message, seconds) in results.items():
            if case_id not in merged or merged[case_id][0] == "passed":
                merged[case_id] = (outcome, message, seconds)
    return merged


@pytest.mark.distributed
@pytest.mark.parametrize("case_id", sorted(CASES), ids=sorted(CASES))
def test_torchrec_case(case_id, suite_results):
    outcome, message, _ = suite_results[case_id]
    assert outcome == "passed", f"{case_id} {outcome}:\n{message}"


def test_not_applicable_list_gives_reasons():
    assert suite.NOT_APPLICABLE and all(len(why) > 20 for why in suite.NOT_APPLICABLE.values())


# ----------------------------------------------------------------------------------------------
# TorchRec's EmbeddingBagCollectionTest, on recxla.nn's module and on TorchRec's.

MODULES = {"recxla.nn": recxla.nn.EmbeddingBagCollection,
           "torchrec": torchrec.EmbeddingBagCollection}
# Every check of TorchRec's EmbeddingBagCollectionTest runs below; none is left out.
EBC_NOT_APPLICABLE = {}


def _tables(*specs, **kwargs):
    return [EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=10,
                               feature_names=list(features), **kwargs)
            for name, dim, features in specs]


def _weighted_input(device="cpu"):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    values = torch.randint(0, 10, (12,), generator=gen)
    return KeyedJaggedTensor.from_offsets_sync(
        keys=["f1", "f3", "f2"], values=values.to(device),
        offsets=torch.tensor([0, 2, 4, 6, 8, 10, 12], device=device),
        weights=torch.rand(12, generator=gen).to(device))


def _same_weights(module, reference):
    module.load_state_dict(reference.state_dict())
    return module


@pytest.fixture(params=sorted(MODULES))
def ebc_class(request):
    return MODULES[request.param]


def test_ebc_unweighted_shared_tables_and_features(ebc_class):
    init = partial(torch.nn.init.normal_, mean=0.0, std=1.5)
    features = KeyedJaggedTensor.from_offsets_sync(
        keys=["f1", "f2"], values=torch.randint(0, 10, (8,)),
        offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8]))
    for specs, keys, offsets in (
        ((("t1", 3, ["f1"]), ("t2", 4, ["f2"])), ["f1", "f2"], [0, 3, 7]),   # unweighted
        ((("t1", 3, ["f1", "f2"]),), ["f1", "f2"], [0, 3, 6]),               # shared table
    ):
        ebc = ebc_class(tables=_tables(*specs, init_fn=init))
        out = ebc(features)
        assert (out.values().shape, out.keys(), out.offset_per_key()) == \
            ((3, offsets[-1]), keys, offsets)
        ref = _same_weights(torchrec.EmbeddingBagCollection(tables=_tables(*specs)), ebc)
        torch.testing.assert_close(out.values(), ref(features).values())
    shared = ebc_class(tables=_tables(("t1", 3, ["f1"]), ("t2", 4, ["f1"])))  # shared feature
    out = shared(KeyedJaggedTensor.from_offsets_sync(
        keys=["f1"], values=torch.randint(0, 10, (8,)),
        offsets=torch.tensor([0, 2, 2, 3, 4, 5, 8])))
    assert (out.values().shape, out.keys(), out.offset_per_key()) == \
        ((6, 7), ["f1@t1", "f1@t2"], [0, 3, 7])


def test_ebc_weighted(ebc_class):
    specs = (("t1", 3, ["f1", "f3"]), ("t2", 4, ["f2"]))
    ebc = ebc_class(tables=_tables(*specs), is_weighted=True)
    features = _weighted_input()
    out = ebc(features)
    assert (out.values().shape, out.keys(), out.offset_per_key()) == \
        ((2, 10), ["f1", "f3", "f2"], [0, 3, 6, 10])
    ref = _same_weights(torchrec.EmbeddingBagCollection(tables=_tables(*specs),
                                                        is_weighted=True), ebc)
    torch.testing.assert_close(out.values(), ref(features).values())


def test_ebc_forward_with_meta_device(ebc_class):
    ebc = ebc_class(tables=_tables(("t1", 3, ["f1", "f3"]), ("t2", 4, ["f2"])),
                    is_weighted=True, device=torch.device("meta"))
    out = ebc(_weighted_input("meta"))
    assert (out.values().shape, out.keys(), out.offset_per_key()) == \
        ((2, 10), ["f1", "f3", "f2"], [0, 3, 6, 10])
    assert out.values().device == torch.device("meta")


def test_ebc_fx_then_script(ebc_class):
    ebc = ebc_class(tables=_tables(("t1", 3, ["f1", "f3"]), ("t2", 4, ["f2"])),
                    is_weighted=True)
    gm = symbolic_trace(ebc)
    torch.jit.script(gm)
    features = _weighted_input()
    out = gm(features)
    assert (out.values().shape, out.keys(), out.offset_per_key()) == \
        ((2, 10), ["f1", "f3", "f2"], [0, 3, 6, 10])
    torch.testing.assert_close(out.values(), ebc(features).values())


def test_ebc_scripting(ebc_class):
    ebc = ebc_class(tables=_tables(("t1", 3, ["f1"])))
    scripted = torch.jit.script(ebc)
    features = KeyedJaggedTensor.from_offsets_sync(
        keys=["f1"], values=torch.randint(0, 10, (5,)), offsets=torch.tensor([0, 2, 2, 5]))
    torch.testing.assert_close(scripted(features).values(), ebc(features).values())


def test_ebc_duplicate_config_name_fails(ebc_class):
    with pytest.raises(ValueError):
        ebc_class(tables=_tables(("t1", 3, ["f1"]), ("t1", 4, ["f2"])))


def test_ebc_device(ebc_class):
    tables = _tables(("t1", 3, ["f1"]))
    ebc = ebc_class(tables=tables, device=torch.device("meta"))
    assert ebc.embedding_bags["t1"].weight.device == torch.device("meta") == ebc.device
    with torch.device("meta"):
        ebc = ebc_class(tables=tables)
    assert ebc.embedding_bags["t1"].weight.device == torch.device("meta") == ebc.device
    ebc = ebc_class(tables=tables)
    assert ebc.embedding_bags["t1"].weight.device == torch.device("cpu") == ebc.device
