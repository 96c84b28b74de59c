"""TorchRec's own tests with recxla swapped in, each beside TorchRec's own pieces as the control
(docs/torchrec-suite.md).

1. The model-parallel, state-dict and sparse-only tests of the torchrec wheel's harness
   (tests/torchrec_suite_cases.py: the cases, the swaps, and NOT_APPLICABLE, the one list of
   TorchRec tests that cannot apply to recxla, with the reason). Every case runs once, in one pair
   of gloo ranks, the first time any of them is asked for; each is then its own test here.
2. TorchRec's EmbeddingBagCollectionTest (torchrec/modules/tests/test_embedding_modules.py in
   TorchRec's repository: not in the wheel), its checks on recxla.nn.EmbeddingBagCollection and,
   as the control, on TorchRec's module, with the outputs compared between the two.
3. TorchRec's QuantizationCommCodecTest.test_quantized_comm_codec
   (torchrec/distributed/tests/test_fbgemm_qcomm_codec.py: not in the wheel either), its body as
   TorchRec writes it, on recxla's codecs and, as the control, on FBGEMM's.
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
        if report.when != "call" or not name.startswith(
                ("test_torchrec_case[", "test_ebc_", "test_quantized_comm_codec[")):
            return
        param = name[name.index("[") + 1 : -1]
        variant = CASES[param].variant if param in CASES else param.split(":")[0]
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


# ----------------------------------------------------------------------------------------------
# TorchRec's QuantizationCommCodecTest.test_quantized_comm_codec, on recxla's codecs
# (suite.recxla_qcomm_codecs) and on FBGEMM's (TorchRec's get_qcomm_codecs: the control).

def _quantized_comm_codec(get_qcomm_codecs, rowwise, comm_precision, loss_scale, row_size,
                          col_size, rand_seed, row_dim):
    """TorchRec's test body, line for line. `rowwise` stands for its
    `torch.cuda.device_count() != 0`, the condition for FBGEMM's row-wise FP8, which runs on CUDA
    only (and, there, on the flattened tensor): recxla's runs on CPU, so its variant takes that
    branch too. loss_scale is drawn and unused, as in TorchRec's test."""
    from hypothesis import assume
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig

    if comm_precision == CommType.FP8:
        if row_dim > 0:
            assume((col_size * row_size) % row_dim == 0)
        assume(col_size % 4 == 0)

    torch.manual_seed(rand_seed)
    shape = (row_size, col_size)
    input_tensor = torch.rand(shape, requires_grad=True)
    cur_row_dim = None

    if comm_precision == CommType.FP8 and rowwise and row_dim > 0:
        cur_row_dim = row_dim
        input_tensor = input_tensor.view(-1)
        if torch.cuda.is_available():
            input_tensor = input_tensor.cuda()

    quant_codec = get_qcomm_codecs(
        QCommsConfig(forward_precision=comm_precision, fp8_quantize_dim=cur_row_dim))
    ctx = quant_codec.forward.create_context()
    if comm_precision == CommType.INT8:
        assume(row_size * col_size % ctx.row_dim == 0)
        input_tensor = input_tensor.view(-1)

    quant_tensor = quant_codec.forward.encode(input_tensor, ctx)
    output_tensor = quant_codec.forward.decode(quant_tensor, ctx)

    rtol = 0.005
    atol = 0.005
    if comm_precision == CommType.FP8:
        rtol = 0.05
        atol = 0.05

    torch.testing.assert_close(
        input_tensor.detach().cpu(), output_tensor.detach().cpu(), rtol=rtol, atol=atol)


def _codec_cases():
    """(id, variant, precision name, loss_scale, rows, cols, row_dim): the arguments TorchRec's
    strategy draws (precision and loss scale from its list, rows and cols in [4, 256], row_dim in
    {-1, 4, 8, 16, 32}), chosen: every precision, and for FP8 every row_dim on the shapes its
    assumptions admit, [4, 8] and [4, 4] among them. INT8 runs as the control only (see
    NOT_APPLICABLE)."""
    out = []
    for variant in ("torchrec", suite.CODECS):
        rows = [("FP32", None, 37, 12, -1), ("FP16", None, 37, 12, -1),
                ("FP16", 4.0, 5, 256, -1), ("BF16", None, 256, 4, -1)]
        if variant == "torchrec":
            rows += [("INT8", None, 4, 8, -1), ("INT8", None, 24, 36, -1)]
        for row_dim in (-1, 4, 8, 16, 32):
            for r, c in ((4, 8), (4, 4), (24, 36), (256, 256)):
                if row_dim < 0 or (r * c) % row_dim == 0:
                    rows.append(("FP8", None, r, c, row_dim))
        for precision, scale, r, c, row_dim in rows:
            name = f"{variant}:{precision}{'' if scale is None else f'x{scale}'}:{r}x{c}:" \
                   f"row_dim={row_dim}"
            out.append((name, variant, precision, scale, r, c, row_dim))
    return out


CODEC_CASES = {case[0]: case[1:] for case in _codec_cases()}


@pytest.mark.parametrize("case", sorted(CODEC_CASES), ids=sorted(CODEC_CASES))
def test_quantized_comm_codec(case, seed):
    """recxla's FP8 codec used to fail here: the flat tensor in rows of 32, so [4, 8] came
    back as (32,) and [4, 4] raised (16 values, not whole rows of 32)."""
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, get_qcomm_codecs

    variant, precision, scale, rows, cols, row_dim = CODEC_CASES[case]
    if variant == "torchrec":
        codecs, rowwise = get_qcomm_codecs, torch.cuda.device_count() != 0
    else:
        codecs, rowwise = suite.recxla_qcomm_codecs, True
    _quantized_comm_codec(codecs, rowwise, CommType[precision], scale, rows, cols,
                          seed % 65535, row_dim)
