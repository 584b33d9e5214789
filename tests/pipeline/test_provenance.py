"""qsa_ops.provenance: the manifest written at build time and the check made at run time."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest

from custom_esimd_kernels_vllm.qsa_ops import provenance


@pytest.fixture
def fake_install(tmp_path, monkeypatch):
    """A package directory holding a fake library, listed as the one torch.ops loaded."""
    pkg = tmp_path / "custom_esimd_kernels_vllm"
    pkg.mkdir()
    dso = pkg / provenance.DSO_NAME
    dso.write_bytes(b"\x7fELF fake library bytes")
    import torch

    monkeypatch.setattr(torch.ops, "loaded_libraries", {str(dso)})
    monkeypatch.setattr(provenance, "_PACKAGE_DIR", pkg)
    return tmp_path, dso


def write_manifest(root, dso, **overrides):
    manifest = provenance.make_manifest(
        target={"name": "cuda-sm90"},
        toolchain={"nvcc": "Cuda compilation tools, release 13.0, V13.0.88"},
        sources={"csrc/a.cu": "0" * 64},
        git={"commit": "abc", "dirty": False},
        dso_path=dso,
        root=root,
        build={"command": "python setup.py build_ext --inplace"},
        version="0.1.0",
    )
    manifest["dso"].update(overrides)
    (dso.parent / provenance.MANIFEST_NAME).write_text(json.dumps(manifest))
    return manifest


def test_sha256_file_matches_hashlib(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(bytes(range(256)) * 5000)  # more than one read chunk
    assert provenance.sha256_file(f) == hashlib.sha256(f.read_bytes()).hexdigest()
    assert provenance.sha256_file(f, chunk=7) == provenance.sha256_file(f)


def test_manifest_records_the_dso_relative_to_the_root(fake_install):
    root, dso = fake_install
    manifest = write_manifest(root, dso)
    assert manifest["schema"] == provenance.SCHEMA
    assert manifest["dso"] == {
        "path": "custom_esimd_kernels_vllm/_C.so",
        "sha256": hashlib.sha256(dso.read_bytes()).hexdigest(),
        "size": dso.stat().st_size,
    }
    listing = "".join(f"{sha}  {name}\n" for name, sha in manifest["sources"].items())
    assert manifest["sources_sha256"] == hashlib.sha256(listing.encode()).hexdigest()


def test_check_passes_when_the_loaded_dso_is_the_manifest_one(fake_install):
    root, dso = fake_install
    write_manifest(root, dso)
    evidence = provenance.check()
    assert evidence["dso"]["sha256"] == evidence["manifest_dso"]["sha256"]
    assert evidence["target"] == "cuda-sm90"
    assert provenance.summary()["matches_manifest"] is True


def test_check_refuses_a_different_dso(fake_install):
    root, dso = fake_install
    write_manifest(root, dso, sha256="f" * 64)
    with pytest.raises(provenance.ProvenanceError, match=r"manifest says f{64}"):
        provenance.check()
    assert provenance.summary()["matches_manifest"] is False


def test_check_refuses_a_dso_changed_on_disk_after_the_build(fake_install):
    root, dso = fake_install
    write_manifest(root, dso)
    dso.write_bytes(b"\x7fELF rebuilt with other flags")
    with pytest.raises(provenance.ProvenanceError, match="has SHA256"):
        provenance.check()


def test_check_refuses_a_missing_manifest(fake_install):
    with pytest.raises(provenance.ProvenanceError, match="not built by the pipeline"):
        provenance.check()
    assert provenance.summary()["manifest"] is None


def test_check_refuses_a_manifest_naming_another_file(fake_install):
    root, dso = fake_install
    write_manifest(root, dso, path="custom_esimd_kernels_vllm/_C.other.so")
    with pytest.raises(provenance.ProvenanceError, match="is not the file the manifest names"):
        provenance.check()


def test_cli_check_exit_codes(fake_install, capsys):
    root, dso = fake_install
    assert provenance.main(["--check"]) == 1
    assert "provenance check FAILED" in capsys.readouterr().err
    write_manifest(root, dso)
    assert provenance.main(["--check"]) == 0
    assert json.loads(capsys.readouterr().out)["target"] == "cuda-sm90"


def test_source_digests_cover_every_file_and_skip_caches(tmp_path):
    (tmp_path / "csrc" / "qsa").mkdir(parents=True)
    (tmp_path / "csrc" / "qsa" / "k.cu").write_text("kernel")
    (tmp_path / "csrc" / "b.cpp").write_text("bindings")
    (tmp_path / "csrc" / "__pycache__").mkdir()
    (tmp_path / "csrc" / "__pycache__" / "x.pyc").write_bytes(b"cache")
    (tmp_path / "setup.py").write_text("setup()")
    digests = provenance.source_digests(tmp_path, ["csrc", "setup.py"])
    assert list(digests) == ["csrc/b.cpp", "csrc/qsa/k.cu", "setup.py"]
    assert digests["setup.py"] == hashlib.sha256(b"setup()").hexdigest()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        provenance.source_digests(tmp_path, ["missing.txt"])


def test_git_state_reports_commit_and_dirty_flag(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    assert provenance.git_state(tmp_path)["commit"] is None  # not a checkout
    git("init", "-q")
    (tmp_path / "a.txt").write_text("a")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    clean = provenance.git_state(tmp_path)
    assert len(clean["commit"]) == 40 and clean["dirty"] is False
    (tmp_path / "a.txt").write_text("changed")
    dirty = provenance.git_state(tmp_path)
    assert dirty["dirty"] is True and dirty["dirty_paths"] == ["a.txt"]


def test_the_one_source_hash_rule(tmp_path):
    for name in provenance.SOURCES:
        path = tmp_path / name
        if "." in name:
            path.write_text(name)
        else:
            (path / "qsa").mkdir(parents=True)
            (path / "qsa" / "qsa.h").write_text("header")
    files = provenance.source_files(tmp_path)
    assert files == ["build_targets.py", "csrc/qsa/qsa.h", "pyproject.toml", "setup.py"]
    listing = "".join(
        f"{hashlib.sha256((tmp_path / f).read_bytes()).hexdigest()}  {f}\n" for f in files
    )
    assert provenance.source_sha256(tmp_path) == hashlib.sha256(listing.encode()).hexdigest()
    manifest = provenance.make_manifest(
        target={}, toolchain={}, sources=provenance.source_digests(tmp_path), git={},
        dso_path=tmp_path / "setup.py", root=tmp_path, build={}, version="0",
    )  # fmt: skip
    assert manifest["sources_sha256"] == provenance.source_sha256(tmp_path)


def test_dso_files_find_the_stable_abi_library(tmp_path):
    assert provenance.dso_files(tmp_path) == []
    (tmp_path / provenance.DSO_NAME).write_bytes(b"\x7fELF")
    assert [p.name for p in provenance.dso_files(tmp_path)] == ["_C.so"]


def test_an_exported_tree_takes_the_exporters_git_state(tmp_path, monkeypatch):
    """Outside git (the container build's export) git_state() is the one the exporter passed
    in QSA_GIT_STATE; without it, commit None."""
    monkeypatch.delenv(provenance.GIT_STATE_ENV, raising=False)
    assert provenance.git_state(tmp_path)["commit"] is None
    given = {"commit": "a" * 40, "dirty": False, "dirty_paths": []}
    monkeypatch.setenv(provenance.GIT_STATE_ENV, json.dumps(given))
    assert provenance.git_state(tmp_path) == given


@pytest.mark.parametrize("value", ["not json", "[]", '{"commit": "abc"}'])
def test_a_malformed_exported_git_state_refuses_naming_the_variable(tmp_path, monkeypatch, value):
    monkeypatch.setenv(provenance.GIT_STATE_ENV, value)
    with pytest.raises(ValueError, match=rf"{provenance.GIT_STATE_ENV} must be a JSON object"):
        provenance.git_state(tmp_path)
