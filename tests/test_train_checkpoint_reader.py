"""A resume trusts nothing in a checkpoint folder that the folder's marker does not vouch for
(recxla.train.checkpoint_reader). One run of 2 gloo ranks writes checkpoints of 2 and 4 steps;
each test damages the newest one as a disk, a copy or an attacker would (bytes changed in a
data file, a data file truncated, bytes flipped in DCP's `.metadata`, a `.metadata` replaced by
a pickle that runs a command) and resumes: every rank exits 2 before any process group exists,
naming the folder, the file and what to do; the checkpoint is left as it was and nothing of a
planted file runs. In one process: load() refuses the same, a planted byte item too, and a
resume from an older checkpoint happens when asked for, naming the newer one it passes over."""

import hashlib
import json
import os
import pickle
import re
import shutil

import pytest
import torch
from test_train_checkpoint import FP32
from test_train_cli import SMALL, _free_port, launch_ranks, start_ranks, wait_ranks

from recxla.train import checkpoint
from recxla.train.parse import parse_config

RUN = [*SMALL, "--checkpoint-every", "2", "--warmup-steps", "1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint folder holding step_00000002 and step_00000004 of one 2-rank run."""
    folder = tmp_path_factory.mktemp("trained")
    launch_ranks([*RUN, "--steps", "4", "--checkpoint-dir", str(folder / "ck")], folder)
    return folder / "ck"


def _copy(trained, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(trained, ck)
    return ck, checkpoint.checkpoint_path(str(ck), 4)


def _xor(path, n, where=0.5):
    """Flip every bit of `n` bytes of file `path` at fraction `where` of it."""
    offset = int(os.path.getsize(path) * where)
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def _contents(folder):
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest()
            for name in sorted(os.listdir(folder))}


def _resume(ck, tmp_path):
    """Resume the run to 6 steps: (exit codes, every rank's output)."""
    logs = tmp_path / "resume"
    logs.mkdir()
    ranks = start_ranks([*RUN, "--steps", "6", "--checkpoint-dir", str(ck), "--resume"], logs)
    codes = wait_ranks(ranks, 150)
    return codes, [r.output() for r in ranks]


def _refused(ck, tmp_path, file, planted=None):
    """Resume; no rank may run code planted to create file `planted`; every rank must exit 2,
    rank 0 naming the newest checkpoint and `file` and pointing at the older one, and the
    folder must be left as it was. Returns rank 0's output."""
    folder = checkpoint.checkpoint_path(str(ck), 4)
    before = _contents(ck / "step_00000004")
    codes, outputs = _resume(ck, tmp_path)
    assert planted is None or not planted.exists(), outputs[0][-3000:]
    out = outputs[0]  # (each node's first rank prints a bad input; every rank exits 2)
    assert f"checkpoint {folder}: {file}: " in out, out[-3000:]
    assert "--resume-step 2" in out and "Traceback" not in "".join(outputs), out[-3000:]
    assert codes == [2, 2], out[-3000:]
    assert _contents(ck / "step_00000004") == before  # not deleted, not changed
    assert sorted(os.listdir(ck)) == ["step_00000002", "step_00000004"]  # nothing trained
    return out


def test_resume_refuses_changed_bytes_in_a_data_file(trained, tmp_path):
    ck, folder = _copy(trained, tmp_path)
    _xor(os.path.join(folder, "__0_0.distcp"), 64)
    assert "its sha256 is not the one" in _refused(ck, tmp_path, "__0_0.distcp")


def test_resume_never_deletes_a_checkpoint_with_a_truncated_file(trained, tmp_path):
    ck, folder = _copy(trained, tmp_path)
    path = os.path.join(folder, "__1_0.distcp")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    assert "truncated since" in _refused(ck, tmp_path, "__1_0.distcp")


def test_resume_step_goes_on_from_the_older_checkpoint_the_error_names(trained, tmp_path):
    """The refusal's advice works: --resume-step 2 trains on from step 2 past the damaged step
    4, which stays until the run writes a checkpoint of 4 steps itself."""
    ck, folder = _copy(trained, tmp_path)
    _xor(os.path.join(folder, "__0_0.distcp"), 64)
    logs = tmp_path / "older"
    logs.mkdir()
    ranks = start_ranks([*RUN, "--steps", "6", "--checkpoint-dir", str(ck), "--resume",
                         "--resume-step", "2", "--metrics", str(logs / "m.json")], logs)
    assert wait_ranks(ranks, 150) == [0, 0], ranks[0].output()[-3000:]
    with open(logs / "m.json") as f:
        assert json.load(f)["resumed_from_step"] == 2
    assert sorted(os.listdir(ck)) == ["step_00000002", "step_00000004", "step_00000006"]
    checkpoint.read_train_state(checkpoint.checkpoint_path(str(ck), 4))  # rewritten: verifies


def test_resume_step_needs_resume_and_an_existing_step(trained, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config([*RUN, "--checkpoint-dir", str(trained), "--resume-step", "2"])
    assert e.value.code == 2 and "--resume-step applies with --resume" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        parse_config([*RUN, "--checkpoint-dir", str(trained), "--resume", "--resume-step", "3"])
    assert e.value.code == 2
    assert "--resume-step 3" in capsys.readouterr().err  # names the steps the folder holds


def test_resume_refuses_flipped_bytes_in_the_metadata(trained, tmp_path):
    ck, folder = _copy(trained, tmp_path)
    _xor(os.path.join(folder, ".metadata"), 16)
    _refused(ck, tmp_path, ".metadata")


class _Payload:
    """Unpickled, runs a command that creates file `path`."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def _plant(folder, name, data, checksum=True):
    """Replace file `name` of checkpoint `folder` by `data` and record its size (and with
    `checksum`, its SHA-256) in the marker, as an attacker would."""
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)
    marker_path = os.path.join(folder, checkpoint.STATE_FILE)
    with open(marker_path) as f:
        marker = json.load(f)
    entry = marker["files"][name]
    if isinstance(entry, dict):
        entry["bytes"] = len(data)
        if checksum:
            entry["sha256"] = hashlib.sha256(data).hexdigest()
    else:  # a marker of sizes alone
        marker["files"][name] = len(data)
    with open(marker_path, "w") as f:
        json.dump(marker, f)


@pytest.mark.parametrize("marker", ["size fixed", "size and checksum fixed"])
def test_resume_runs_no_code_planted_in_the_metadata(trained, tmp_path, marker):
    ck, folder = _copy(trained, tmp_path)
    ran = tmp_path / "planted-code-ran"
    _plant(folder, ".metadata", pickle.dumps(_Payload(ran)), checksum=marker != "size fixed")
    out = _refused(ck, tmp_path, ".metadata", planted=ran)
    if marker == "size and checksum fixed":  # the checksums match: the unpickler refuses it
        assert "system, which is none of DCP's metadata types" in out, out[-3000:]


@pytest.fixture
def one_rank():
    """A 1-rank gloo process group in this process."""
    store = torch.distributed.TCPStore("127.0.0.1", _free_port(), 1, is_master=True)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def _error_of(fn, *args):
    """The ValueError `fn(*args)` raises (None if it returns)."""
    try:
        fn(*args)
    except ValueError as e:
        return e
    return None


def _model():
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    model(torch.randn(7, 5)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(directory, step, model, optimizer):
    config = parse_config([*FP32, "--steps", "8"])
    return checkpoint.save(str(directory), step, model, optimizer, config, 1)


def test_load_runs_no_code_planted_in_the_metadata(one_rank, tmp_path):
    model, optimizer = _model()
    folder = _save(tmp_path, 2, model, optimizer)
    ran = tmp_path / "planted-code-ran"
    _plant(folder, ".metadata", pickle.dumps(_Payload(ran)))
    error = _error_of(checkpoint.load, folder, model, optimizer)
    assert not ran.exists()
    assert re.match(rf"checkpoint {folder}: \.metadata: not DCP's index", str(error)), error


def test_load_runs_no_code_planted_in_a_byte_item(one_rank, tmp_path):
    """A non-tensor value (the optimizer's learning rate) is a byte item of a data file, which
    DCP loads with torch.load(weights_only=False): replaced by a pickle that runs a command
    (offsets and marker made to match), load() refuses it and nothing runs."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    model, optimizer = _model()
    folder = _save(tmp_path, 2, model, optimizer)
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        metadata = pickle.load(f)  # the test's own file: trusted
    fqn = next(k for k, v in metadata.state_dict_metadata.items()
               if isinstance(v, BytesStorageMetadata) and k.endswith(".lr"))
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == fqn)
    ran = tmp_path / "planted-code-ran"
    payload = torch.serialization.io.BytesIO()
    torch.save(_Payload(ran), payload)
    payload = payload.getvalue()
    with open(os.path.join(folder, info.relative_path), "rb") as f:
        data = f.read()
    data = data[:info.offset] + payload + data[info.offset + info.length:]
    shift = len(payload) - info.length
    for s in metadata.storage_data.values():
        if s.relative_path == info.relative_path and s.offset > info.offset:
            s.offset += shift
    info.length = len(payload)
    _plant(folder, info.relative_path, data)
    _plant(folder, ".metadata", pickle.dumps(metadata))
    error = _error_of(checkpoint.load, folder, model, optimizer)
    assert not ran.exists()
    assert re.match(rf"checkpoint {folder}: {info.relative_path}: its entry '{fqn}' does not "
                    r"load with torch.load\(weights_only=True\)", str(error)), error


def test_resume_from_an_older_checkpoint_only_when_asked(one_rank, tmp_path, capsys):
    model, optimizer = _model()
    older = _save(tmp_path, 2, model, optimizer)
    model(torch.randn(7, 5)).sum().backward()
    optimizer.step()
    newer = _save(tmp_path, 4, model, optimizer)
    _xor(os.path.join(newer, "__0_0.distcp"), 8)
    # By default the newest, which does not verify: refused, pointing at the older one.
    assert checkpoint.resume_checkpoint(str(tmp_path)) == (4, newer)
    with pytest.raises(ValueError, match=rf"checkpoint {newer}: __0_0.distcp: its sha256 .* add "
                       r"--resume-step 2 "):
        checkpoint.read_train_state(newer)
    with pytest.raises(ValueError, match=rf"checkpoint {newer}: __0_0.distcp: its sha256"):
        checkpoint.load(newer, model, optimizer)
    # Asked for: the older one, the newer one named with the reason it is passed over, kept.
    assert checkpoint.resume_checkpoint(str(tmp_path), 2) == (2, older)
    assert checkpoint.read_train_state(older)["steps_done"] == 2
    capsys.readouterr()
    assert checkpoint.load(older, model, optimizer) == 2
    assert f"resuming from {older}, not from the newer {newer} (__0_0.distcp: its sha256" in \
        capsys.readouterr().out
    assert os.path.isdir(newer)
    with pytest.raises(ValueError, match=r"--resume-step 3: .* holds no checkpoint of 3 steps "
                       r"\(it holds: 2, 4\)"):
        checkpoint.resume_checkpoint(str(tmp_path), 3)
