"""TorchRec's own CPU/gloo tests, run with recxla swapped in and with TorchRec's pieces as the
control (tests/test_torchrec_suite.py drives this module; docs/torchrec-suite.md explains it).

The tests are those of the installed torchrec wheel's harness
(torchrec/distributed/test_utils/): TorchRec's repository runs them through three gloo
subclasses (ModelParallelTestGloo, ModelParallelStateDictTestGloo,
ModelParallelSparseOnlyTestGloo); so do we, with the pieces they build swapped through the
harness's own extension points:
- its sharder factory (`create_test_sharder`, and `get_default_sharders` where a test lets DMP
  pick): recxla.torchrec.EmbeddingBagCollectionSharder, or TorchRec's sharder with
  recxla.torchrec.qcomm_codecs_registry;
- the embedding module its TestSparseNN builds (`EmbeddingBagCollection`):
  recxla.nn.EmbeddingBagCollection;
- `_run_multi_process_test`, which would spawn two processes per case: here it runs this rank's
  half of the harness's per-rank body (`sharding_single_rank_test_single_process`) in a process
  group made for the case, so one pair of processes runs every case.

A case names a TorchRec test and the arguments its hypothesis strategy would draw (TorchRec's
test body itself runs, through `.hypothesis.inner_test`, wherever it runs on gloo).
"""

import datetime
import time
import traceback
import unittest.mock
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

# What recxla swaps in, and what TorchRec's own pieces are (the control).
RECXLA, TORCHREC, CODECS, MODULE = "recxla", "torchrec", "torchrec+recxla-codecs", "recxla.nn"
CASE_TIMEOUT_S = 120  # a collective one rank never joins fails the case instead of hanging

TW, CW, TWCW, RW, TWRW, DP = ("table_wise", "column_wise", "table_column_wise", "row_wise",
                              "table_row_wise", "data_parallel")
FP32, FP16_BF16 = "fp32", "fp16-bf16"  # comms: none (fp32), or fp16 forward / bf16 backward
OIB = {"embedding_bags": ("SGD", {"lr": 0.01}), "embeddings": ("SGD", {"lr": 0.2})}
# The harness's per-rank body on its mixed pooled + sequence model (no test method of the
# wheel's classes runs that model on gloo; the body and the model are the wheel's).
MIXED = "sharding_single_rank_test(TestMixedEmbeddingSparseArch)"


@dataclass(frozen=True)
class Case:
    """One run of a TorchRec test: `test` (Class.method of the harness), the `variant` swapped
    in, and the test's arguments (`params`, as its hypothesis strategy draws them)."""

    test: str
    variant: str
    params: Tuple[Tuple[str, Any], ...] = ()
    ranks: int = 2  # 2: over the shared pair of gloo ranks; 1: TorchRec's single-rank tests

    @property
    def id(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{self.test}[{self.variant}{':' if args else ''}{args}]"


def _sharding(test: str, sharding_type: str, comms: str, oib: bool, uneven: bool,
              dtype: str = "FP32", pooling: str = "SUM", variants=(RECXLA, TORCHREC)):
    params = (("sharding_type", sharding_type), ("comms", comms), ("oib", oib),
              ("uneven", uneven), ("dtype", dtype), ("pooling", pooling))
    out = [Case(test, v, params) for v in variants]
    if comms != FP32 and TORCHREC in variants:
        out.append(Case(test, CODECS, params))
    return out


def _grid() -> List[Case]:
    """Sharding type x comms x optimizer placement x batch evenness x table dtype: per type a
    covering set of four rows (every pair of the two-valued factors is met at least once), each
    with recxla's sharder and TorchRec's, plus TorchRec's sharder on recxla's codecs where the
    comms are quantized."""
    rows = [(FP32, False, False, "FP32"), (FP16_BF16, True, True, "FP32"),
            (FP16_BF16, False, False, "FP16"), (FP32, True, True, "FP16")]
    cases = []
    for test, st in (("test_sharding_tw", TW), ("test_sharding_cw", CW),
                     ("test_sharding_twcw", TWCW), ("test_sharding_rw", RW),
                     ("test_sharding_twrw", TWRW)):
        for i, (comms, oib, uneven, dtype) in enumerate(rows):
            pooling = "MEAN" if st in (RW, TWRW) and i == 1 else "SUM"
            variants = (RECXLA, TORCHREC)
            if st in (RW, TWRW) and uneven:
                variants = (RECXLA,)  # see NOT_APPLICABLE: TorchRec's sharder on gloo
            cases += _sharding(test, st, comms, oib, uneven, dtype, pooling, variants)
    return cases


def cases() -> List[Case]:
    out = _grid()
    # Data-parallel tables, and the harness's model on recxla.nn's module.
    out += _sharding("test_sharding_dp", DP, FP32, False, False)
    out += _sharding("test_sharding_tw", TW, FP32, False, True, variants=(MODULE,))
    out += _sharding("test_sharding_rw", RW, FP16_BF16, True, False, variants=(MODULE,))
    # Variable batch per feature (VBE): TorchRec's sharder cannot run it on CPU.
    out += [Case("test_sharding_variable_batch", RECXLA, (("sharding_type", st),))
            for st in (TW, RW)]
    # TorchRec's single-rank tests (ModelParallelStateDictTestGloo, ...SparseOnlyTestGloo).
    single = [("test_meta_device_dmp_state_dict", ()),
              ("test_load_state_dict_dp", (("is_training", True),))]
    single += [("test_load_state_dict", (("sharding_type", st), ("is_training", True)))
               for st in (TW, CW, RW, TWRW, TWCW)]
    single += [("test_optimizer_load_state_dict", (("sharding_type", st),)) for st in (TW, RW)]
    single += [("test_load_state_dict_prefix", (("sharding_type", CW), ("is_training", True))),
               ("test_params_and_buffers", (("sharding_type", TWRW),)),
               ("test_load_state_dict_cw_multiple_shards", (("is_training", True),)),
               ("test_rowwise_adagrad_numerical_equivalence", ())]
    for test, params in single:
        out += [Case(f"StateDict.{test}", v, params, ranks=1) for v in (RECXLA, TORCHREC)]
    for test in ("test_sharding_ebc_as_top_level", "test_sharding_ebc_input_validation_enabled"):
        out += [Case(f"SparseOnly.{test}", v, (), ranks=1) for v in (RECXLA, TORCHREC)]
    # The harness's model with pooled and sequence tables (TestMixedEmbeddingSparseArch: an
    # EmbeddingBagCollection and an EmbeddingCollection) through its per-rank body, recxla's
    # sharders for both module types; TorchRec's own where its CPU sharders run the plan.
    for st in (TW, CW, RW, TWRW, DP):
        variants = (RECXLA, TORCHREC) if st in (TW, CW) else (RECXLA,)
        out += [Case(MIXED, v, (("sharding_type", st),)) for v in variants]
    return out


# Every TorchRec test of these classes that runs on CPU and is not run above with recxla, and why.
NOT_APPLICABLE: Dict[str, str] = {
    "test_sharding_rw/test_sharding_twrw[torchrec: uneven batches]":
        "control only: TorchRec's own sharder fails row-wise output dist with uneven batches on "
        "gloo (its reduce-scatter-v); TorchRec skips both tests on gloo altogether, recxla runs "
        "them",
    "test_sharding_variable_batch[torchrec]":
        "control only: TorchRec skips it on gloo (FBGEMM's CPU bounds_check_indices takes no "
        "variable batch); recxla runs it",
    "test_sharding_multiple_kernels*, test_sharding_grid*, test_sharding_diff_table_index_type, "
    "test_numerical_equivalence_between_kernel_types, test_dynamic_sharding*":
        "need 2+ GPUs (UVM/caching kernels, grid sharding, resharding a live module); recxla's "
        "sharder offers one CPU kernel (fused) and no live resharding",
    "SparseOnly.test_sharding_fused_ebc_as_top_level":
        "shards torchrec's FusedEmbeddingBagCollection, a module recxla has no sharder for",
    "SparseOnly.test_sharding_ebc_validate_input_only_once":
        "asserts a log line of TorchRec's sharded module ('Validating input features...' on "
        "torchrec's logger), an implementation detail",
    "SparseOnly.test_initialize_torch_state_error_includes_table_name":
        "patches TorchRec's ShardedEmbeddingBagCollection._initialize_torch_state, a private "
        "method recxla's module does not use",
    f"{MIXED}[torchrec: row_wise, table_row_wise]":
        "control only for table-wise and column-wise: TorchRec's CPU sharder of the pooled "
        "tables offers no row-wise; recxla runs them",
    f"{MIXED}[torchrec: data_parallel]":
        "control only for table-wise and column-wise: TorchRec 1.9.2's data-parallel sequence "
        "sharding raises on CPU (split_with_sizes in its output dist); recxla runs it",
    "TorchRec's sequence-model tests (test_sequence_model_parallel.py)":
        "not in the torchrec wheel (they live in its repository's tests/ folder, with the "
        "TestSequenceSparseNN model they need); the wheel's mixed pooled + sequence model runs "
        f"instead ({MIXED}), and tests/test_sharded_embedding.py compares recxla's sequence "
        "module with TorchRec's EC sharder directly",
    "StateDict.test_parameter_init":
        "a plain module with no embeddings: no sharder is involved",
    "EmbeddingBagCollectionTest (recxla.nn)": "see EBC_NOT_APPLICABLE in test_torchrec_suite.py",
    "QuantizationCommCodecTest.test_quantized_comm_codec[torchrec+recxla-codecs: INT8]":
        "recxla has no INT8 wire format (e4m3, e5m2, bf16, fp16, fp32); FBGEMM's INT8 codec runs "
        "as the control",
    "QuantizationCommCodecTest.test_mx4_comm_codec":
        "MX4 (FBGEMM's shared-exponent groups of 32) is not a recxla wire format",
}


# ----------------------------------------------------------------------------------------------
# The swaps (run inside a rank).

def install_harness_stub() -> None:
    """The wheel's test_sharding.py imports TestEmbeddingCollectionSharder from
    torchrec.distributed.tests.test_sequence_model, which the wheel does not ship (its tests/
    folders stay in TorchRec's repository). The harness uses it only for dynamic 2D submodule
    plans, which no case here runs: a stand-in that says so when constructed lets it import."""
    import sys
    import types

    name = "torchrec.distributed.tests.test_sequence_model"
    if name in sys.modules:
        return
    try:
        __import__(name)
        return
    except ImportError:
        pass

    class TestEmbeddingCollectionSharder:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(
                f"{name} is not in the torchrec wheel; dynamic 2D submodule plans cannot run")

    package = types.ModuleType("torchrec.distributed.tests")
    package.__path__ = []
    module = types.ModuleType(name)
    module.TestEmbeddingCollectionSharder = TestEmbeddingCollectionSharder
    package.test_sequence_model = module
    sys.modules.setdefault("torchrec.distributed.tests", package)
    sys.modules[name] = module


def _comms(name: str):
    """(QCommsConfig or None, recxla fwd, recxla bwd) for a comms name."""
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig

    if name == FP32:
        return None, "fp32", "fp32"
    return QCommsConfig(forward_precision=CommType.FP16, backward_precision=CommType.BF16), \
        "fp16", "bf16"


_COMM_NAMES = {"FP32": "fp32", "FP16": "fp16", "BF16": "bf16"}


def _recxla_formats(qcomms_config) -> Tuple[str, str]:
    """recxla's (forward, backward) formats for TorchRec's precisions: FP8 is FBGEMM's 1-4-3
    forward, 1-5-2 backward unless fp8_bwd_uses_143. TorchRec's INT8 and MX4 have none."""
    if qcomms_config is None:
        return "fp32", "fp32"
    fp8 = {"fwd": "e4m3", "bwd": "e4m3" if qcomms_config.fp8_bwd_uses_143 else "e5m2"}
    formats = []
    for direction, precision in (("fwd", qcomms_config.forward_precision),
                                 ("bwd", qcomms_config.backward_precision)):
        if precision.name == "FP8":
            formats.append(fp8[direction])
        elif precision.name in _COMM_NAMES:
            formats.append(_COMM_NAMES[precision.name])
        else:
            raise ValueError(f"recxla has no wire format for TorchRec's {precision.name}")
    return formats[0], formats[1]


def recxla_qcomm_codecs(qcomms_config):
    """TorchRec's get_qcomm_codecs (QCommsConfig -> QuantizedCommCodecs) on recxla's codecs:
    the precisions as recxla's formats, fp8_quantize_dim(_bwd) as the FP8 row_dim (None: none
    configured, as for FBGEMM's codec)."""
    from recxla.torchrec import qcomm_codecs_registry
    from torchrec.distributed.types import CommOp

    if qcomms_config.forward_loss_scale or qcomms_config.backward_loss_scale:
        raise ValueError("recxla's codecs take no loss scale")
    op = CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL
    return qcomm_codecs_registry(
        *_recxla_formats(qcomms_config), row_dim=qcomms_config.fp8_quantize_dim,
        row_dim_bwd=qcomms_config.fp8_quantize_dim_bwd, comm_ops=[op])[op.name]


def _recxla_sharder_class():
    from recxla.torchrec import EmbeddingBagCollectionSharder

    class RecxlaTestEBCSharder(EmbeddingBagCollectionSharder):
        """recxla's sharder restricted to one sharding type and kernel, as the harness's
        TestEBCSharder restricts TorchRec's."""

        def __init__(self, sharding_type, kernel_type, fused_params, qcomms_config,
                     module_type=None):
            fwd, bwd = _recxla_formats(qcomms_config)
            super().__init__(fused_params=fused_params, fwd_comm=fwd, bwd_comm=bwd,
                             module_type=module_type)
            self._sharding_type, self._kernel_type = sharding_type, kernel_type

        def sharding_types(self, compute_device_type):
            return [self._sharding_type]

        def compute_kernels(self, sharding_type, compute_device_type):
            return [self._kernel_type]

    return RecxlaTestEBCSharder


def _factory(variant: str) -> Callable:
    """The harness's create_test_sharder, for `variant`."""
    from torchrec.distributed.test_utils import test_sharding as ts

    if variant == TORCHREC:
        return ts.create_test_sharder

    def create(sharder_type, sharding_type, kernel_type, fused_params=None,
               qcomms_config=None, device=None):
        if sharder_type != ts.SharderType.EMBEDDING_BAG_COLLECTION.value:
            raise ValueError(f"recxla shards EmbeddingBagCollection only, not {sharder_type}")
        fused_params = dict(fused_params or {})
        fused_params.setdefault("learning_rate", 0.1)  # as the harness's factory does
        if variant == CODECS:
            from recxla.torchrec import qcomm_codecs_registry
            from torchrec.distributed.test_utils.emb_sharder import TestEBCSharder

            registry = qcomm_codecs_registry(*_recxla_formats(qcomms_config)) \
                if qcomms_config is not None else {}
            return TestEBCSharder(sharding_type, kernel_type, fused_params, registry)
        module_type = None
        if variant == MODULE:
            import recxla.nn

            module_type = recxla.nn.EmbeddingBagCollection
        return _recxla_sharder_class()(sharding_type, kernel_type, fused_params, qcomms_config,
                                       module_type)

    return create


def _default_sharders(variant: str) -> Callable:
    """get_default_sharders with the EmbeddingBagCollection sharder swapped for `variant`'s."""
    from torchrec.distributed import sharding_plan
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    original = sharding_plan.get_default_sharders
    if variant == TORCHREC:
        return original

    def get_default_sharders():
        from recxla.torchrec import EmbeddingBagCollectionSharder as Recxla

        return [Recxla(fwd_comm="fp32", bwd_comm="fp32") if
                type(s) is EmbeddingBagCollectionSharder else s for s in original()]

    return get_default_sharders


def _patches(variant: str) -> List[Any]:
    """The harness's extension points set for `variant` (context managers)."""
    from torchrec.distributed import model_parallel
    from torchrec.distributed.test_utils import test_model
    from torchrec.distributed.test_utils import test_model_parallel as tmp
    from torchrec.distributed.test_utils import test_model_parallel_base as tmpb

    factory, defaults = _factory(variant), _default_sharders(variant)
    patches = [unittest.mock.patch.object(m, "create_test_sharder", factory) for m in (tmp, tmpb)]
    patches += [unittest.mock.patch.object(m, "get_default_sharders", defaults)
                for m in (tmpb, model_parallel)]
    if variant == MODULE:
        import recxla.nn

        patches.append(unittest.mock.patch.object(test_model, "EmbeddingBagCollection",
                                                  recxla.nn.EmbeddingBagCollection))
    return patches


# ----------------------------------------------------------------------------------------------
# Running the cases (inside the ranks).

def _harness():
    install_harness_stub()
    from torchrec.distributed.test_utils import test_model_parallel as tmp
    from torchrec.distributed.test_utils import test_model_parallel_base as tmpb
    from torchrec.distributed.test_utils import test_sharding as ts

    return tmp, tmpb, ts


def _classes():
    """TorchRec's three gloo test classes (as its repository's test_model_parallel_gloo.py
    declares them), the multi-rank one running its per-rank body on a given process group."""
    tmp, tmpb, ts = _harness()

    class ModelParallelTestGloo(tmp._ModelParallelBase):
        backend = "gloo"
        pg: Optional[dist.ProcessGroup] = None

        def _run_multi_process_test(self, *, callable, world_size=2, **kwargs):
            if callable is not ts.sharding_single_rank_test:
                raise NotImplementedError(f"no shared-group form of {callable.__name__}")
            kwargs.pop("backend", None)
            ts.sharding_single_rank_test_single_process(
                pg=self.pg, device=torch.device("cpu"), rank=dist.get_rank(self.pg),
                world_size=world_size, **kwargs)

    class ModelParallelStateDictTestGloo(tmpb.ModelParallelStateDictBase):
        backend = "gloo"

    class ModelParallelSparseOnlyTestGloo(tmpb.ModelParallelSparseOnlyBase):
        backend = "gloo"

    return ModelParallelTestGloo, ModelParallelStateDictTestGloo, ModelParallelSparseOnlyTestGloo


def _mixed_case(case: Case, pg) -> None:
    """The harness's per-rank body (one train step of the sharded model against the unsharded
    one, TorchRec's tolerances) on TestMixedEmbeddingSparseArch: two pooled tables of two dims
    and two sequence tables, every table planned `sharding_type`."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import ParameterConstraints
    from torchrec.distributed.test_utils.test_model import TestMixedEmbeddingSparseArch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig

    _, _, ts = _harness()
    sharding_type = dict(case.params)["sharding_type"]
    tables = [EmbeddingBagConfig(num_embeddings=(i + 1) * 10, embedding_dim=(i + 2) * 8,
                                 name=f"table_{i}", feature_names=[f"feature_{i}"])
              for i in range(2)]
    tables += [EmbeddingConfig(num_embeddings=(i + 1) * 11, embedding_dim=16,
                               name=f"ec_table_{i}", feature_names=[f"ec_feature_{i}"])
               for i in range(2)]
    fused = {"learning_rate": 0.1}
    if case.variant == RECXLA:
        import recxla.torchrec

        sharders = [recxla.torchrec.EmbeddingBagCollectionSharder(fused_params=fused,
                                                                  fwd_comm="fp32",
                                                                  bwd_comm="fp32"),
                    recxla.torchrec.EmbeddingCollectionSharder(fused_params=fused,
                                                               fwd_comm="fp32", bwd_comm="fp32")]
    else:
        sharders = [EmbeddingBagCollectionSharder(fused_params=fused),
                    EmbeddingCollectionSharder(fused_params=fused)]
    kernel = "dense" if sharding_type == DP else "fused"
    constraints = {t.name: ParameterConstraints(sharding_types=[sharding_type],
                                                compute_kernels=[kernel]) for t in tables}
    ts.sharding_single_rank_test_single_process(
        pg=pg, device=torch.device("cpu"), rank=dist.get_rank(pg), world_size=2,
        model_class=TestMixedEmbeddingSparseArch, embedding_groups={}, tables=tables,
        sharders=sharders, optim=EmbOptimType.EXACT_SGD, constraints=constraints)


def _sharding_case(case: Case, pg) -> None:
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.planner import ParameterConstraints
    from torchrec.modules.embedding_configs import DataType, PoolingType

    tmp, _, ts = _harness()
    cls = _classes()[0]
    p = dict(case.params)
    qcomms, _, _ = _comms(p.get("comms", FP32))
    oib = {k: (getattr(torch.optim, o), dict(kw)) for k, (o, kw) in OIB.items()} if p.get("oib") \
        else None
    dtype = DataType[p.get("dtype", "FP32")]
    pooling = PoolingType[p.get("pooling", "SUM")]
    ebc = ts.SharderType.EMBEDDING_BAG_COLLECTION.value
    fused = EmbeddingComputeKernel.FUSED.value
    test = cls(case.test)
    test.pg = pg
    test.setUp()
    try:
        body = getattr(cls, case.test).hypothesis.inner_test
        if case.test in ("test_sharding_tw", "test_sharding_cw", "test_sharding_twcw"):
            extra = {"allow_zero_batch_size": False} if case.test == "test_sharding_cw" else {}
            body(test, sharder_type=ebc, kernel_type=fused, qcomms_config=qcomms,
                 apply_optimizer_in_backward_config=oib, variable_batch_size=p["uneven"],
                 data_type=dtype, **extra)
        elif case.test == "test_sharding_dp":
            body(test, sharder_type=ebc, kernel_type=EmbeddingComputeKernel.DENSE.value,
                 apply_optimizer_in_backward_config=None, data_type=dtype)
        elif case.test in ("test_sharding_rw", "test_sharding_twrw"):
            # TorchRec's bodies skip on gloo before doing anything; what they do otherwise:
            test._test_sharding(
                sharders=[tmp.create_test_sharder(ebc, p["sharding_type"], fused,
                                                  qcomms_config=qcomms, device=test.device)],
                backend="gloo", qcomms_config=qcomms, apply_optimizer_in_backward_config=oib,
                variable_batch_size=p["uneven"], pooling=pooling, data_type=dtype)
        elif case.test == "test_sharding_variable_batch":
            # Skipped on gloo by TorchRec too (for FBGEMM's CPU kernel); its body otherwise:
            test._test_sharding(
                sharders=[tmp.create_test_sharder(ebc, p["sharding_type"], fused,
                                                  device=test.device)],
                backend="gloo",
                constraints={t: ParameterConstraints(min_partition=4) for t in test.table_names},
                variable_batch_per_feature=True, has_weighted_tables=False,
                global_constant_batch=False, pooling=PoolingType.SUM, data_type=DataType.FP32)
        else:
            raise ValueError(f"no runner for {case.test}")
    finally:
        test.tearDown()


def _single_rank_case(case: Case) -> None:
    import inspect

    from torchrec.distributed.embedding_types import EmbeddingComputeKernel

    _, _, ts = _harness()
    _, state_dict_cls, sparse_only_cls = _classes()
    group, method = case.test.split(".")
    cls = state_dict_cls if group == "StateDict" else sparse_only_cls
    test = cls(method)
    test.setUp()
    try:
        fn = getattr(cls, method)
        if not hasattr(fn, "hypothesis"):
            fn(test)
            return
        body = fn.hypothesis.inner_test
        dp = method == "test_load_state_dict_dp"
        kwargs = {"sharder_type": ts.SharderType.EMBEDDING_BAG_COLLECTION.value,
                  "kernel_type": (EmbeddingComputeKernel.DENSE if dp else
                                  EmbeddingComputeKernel.FUSED).value,
                  "sharding_type": DP if dp else CW if "cw_multiple" in method else TW,
                  **dict(case.params)}
        accepted = inspect.signature(body).parameters
        body(test, **{k: v for k, v in kwargs.items() if k in accepted})
    finally:
        test.tearDown()


def _close_torchrec_groups() -> None:
    """TorchRec caches the intra-/cross-node groups it makes (table-row-wise sharding) in
    torchrec.distributed.comm; the harness's MultiProcessContext closes them after each test, so
    a case never sees the groups of the one before."""
    from torchrec.distributed import comm

    for name in ("_INTRA_PG", "_CROSS_PG", "_INTRA_PG_2D", "_CROSS_PG_2D"):
        group = getattr(comm, name, None)
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except Exception:  # already gone with the group it was made from
                pass
            setattr(comm, name, None)


def _run(case: Case, fn: Callable[[], None]) -> Tuple[str, str, float]:
    """(outcome, message, seconds) of one case: "passed", "failed" or "skipped" (a skip is
    reported as such, never as a pass)."""
    import contextlib

    start = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            for patch in _patches(case.variant):
                stack.enter_context(patch)
            fn()
        outcome, message = "passed", ""
    except unittest.SkipTest as e:
        outcome, message = "skipped", f"TorchRec's test skipped itself: {e}"
    except Exception as e:  # every failure is reported, with its traceback
        outcome = "failed"
        message = f"{type(e).__name__}: {str(e)[:1500]}\n{traceback.format_exc()[-3000:]}"
    finally:
        _close_torchrec_groups()
    return outcome, message, time.monotonic() - start


def _align(store, key: str, rank: int, world: int) -> None:
    """Wait, through the rendezvous store (not the process group, which a failed case may have
    left mid-collective), until every rank has reached `key`."""
    store.set(f"{key}/{rank}", "1")
    store.wait([f"{key}/{r}" for r in range(world)],
               datetime.timedelta(seconds=CASE_TIMEOUT_S + 60))


def run_cases(rank: int, world: int, ids: List[str]) -> Dict[str, Tuple[str, str, float]]:
    """run_distributed's body: every selected two-rank case over a process group of its own,
    then this rank's share of the single-rank cases (TorchRec's single-rank tests set up a
    default group of their own, so the shared one is closed first)."""
    _harness()
    wanted = set(ids)
    selected = [c for c in cases() if c.id in wanted]
    store = dist.distributed_c10d._get_default_store()
    results: Dict[str, Tuple[str, str, float]] = {}
    timeout = datetime.timedelta(seconds=CASE_TIMEOUT_S)
    for i, case in enumerate(c for c in selected if c.ranks == 2):
        pg = dist.new_group(backend="gloo", timeout=timeout)
        run = _mixed_case if case.test == MIXED else _sharding_case
        results[case.id] = _run(case, lambda: run(case, pg))
        _align(store, f"case{i}", rank, world)
        dist.destroy_process_group(pg)
    _align(store, "single-rank", rank, world)
    dist.destroy_process_group()
    for case in [c for c in selected if c.ranks == 1][rank::world]:
        results[case.id] = _run(case, lambda: _single_rank_case(case))
    # run_distributed closes a default group when the body returns: hand it a local one.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return results
