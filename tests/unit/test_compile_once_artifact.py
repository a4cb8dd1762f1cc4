"""Compile once's artifact on disk, without processes: what a loading rank refuses, keeps,
replaces and writes, and what a serving rank collects (``agreements/once/artifact.py``).

A loading rank trusts what torch's own lookup trusts: it refuses only bytes that do not match
their digest, paths outside the cache layout, an entry for another key and a manifest without
an entry. Each test names what the code before issue 29 did where it differs.
"""

from __future__ import annotations

import hashlib
import os
import pathlib

from compiler_collectives.agreements.once import artifact
from compiler_collectives.agreements.wire.once import ManifestFile, Result

KEY = "akey0123"
ENTRY = f"aotautograd/{KEY}/entry0"
PREFIX = f"aotautograd/{KEY}/"
FX = "fxgraph/ab/fkey0123/fxentry0"
SOURCE = "cx/cxstem.main.cpp"
BINARY = "cx/cxstem.main.so"

FILES = {
    ENTRY: b"aot entry pickle",
    FX: b"fx graph entry pickle",
    SOURCE: b"extern void kernel() {}",
    BINARY: b"\x7fELF built in /srv/cache/rank1/cx",
}


def listed(files: dict[str, bytes]) -> list[ManifestFile]:
    return [ManifestFile(rel, hashlib.sha256(data).digest(), len(data)) for rel, data in files.items()]


def pieces(files: dict[str, bytes] = FILES) -> list[tuple[ManifestFile, bytes]]:
    return list(zip(listed(files), files.values()))


def put(root: pathlib.Path, rel: str, data: bytes) -> pathlib.Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def tree(root: pathlib.Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes, and every dir (``name/``), hidden ones included."""
    out: dict[str, bytes] = {}
    for d, dirs, files in os.walk(root):
        for n in dirs:
            out[os.path.relpath(os.path.join(d, n), root) + "/"] = b""
        for n in files:
            out[os.path.relpath(os.path.join(d, n), root)] = pathlib.Path(d, n).read_bytes()
    return out


def staging_left(root: pathlib.Path) -> list[str]:
    return [rel for rel in tree(root) if os.path.basename(rel).startswith(".cc-once-")]


# ---------------------------------------------------------------- rule 2: kernel binaries


def test_a_kernel_binary_built_here_with_other_bytes_beside_its_source_is_kept_and_the_artifact_installs(tmp_path):
    """Old: refused ("exists in this rank's cache dir with other content")."""
    put(tmp_path, SOURCE, FILES[SOURCE])
    put(tmp_path, BINARY, b"\x7fELF built in /srv/cache/rank0/cx")
    outcome = artifact.install(str(tmp_path), pieces())
    assert outcome == artifact.Accepted(written=2, replaced=(), kept=(BINARY,))
    assert (tmp_path / ENTRY).read_bytes() == FILES[ENTRY] and (tmp_path / FX).read_bytes() == FILES[FX]


def test_a_kept_kernel_binary_is_not_overwritten(tmp_path):
    """Old: refused, so never overwritten either; a process may have the file mapped."""
    put(tmp_path, SOURCE, FILES[SOURCE])
    binary = put(tmp_path, BINARY, b"\x7fELF built in /srv/cache/rank0/cx")
    before = binary.stat()
    artifact.install(str(tmp_path), pieces())
    after = binary.stat()
    assert binary.read_bytes() == b"\x7fELF built in /srv/cache/rank0/cx"
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_binary_beside_a_source_with_other_bytes_is_replaced_with_its_source(tmp_path):
    """Old: refused. Not an equivalent build (its source is torn or stale): both are replaced."""
    put(tmp_path, SOURCE, b"extern void kern")
    put(tmp_path, BINARY, b"\x7fELF from a torn source")
    outcome = artifact.install(str(tmp_path), pieces())
    assert isinstance(outcome, artifact.Accepted)
    assert sorted(outcome.replaced) == sorted([BINARY, SOURCE]) and outcome.kept == ()
    assert (tmp_path / BINARY).read_bytes() == FILES[BINARY] and (tmp_path / SOURCE).read_bytes() == FILES[SOURCE]


def test_a_binary_whose_source_is_not_here_is_replaced(tmp_path):
    """Old: refused. Without its source beside it nothing shows the binary is this kernel's build."""
    put(tmp_path, BINARY, b"\x7fELF of unknown origin")
    outcome = artifact.install(str(tmp_path), pieces())
    assert isinstance(outcome, artifact.Accepted) and outcome.replaced == (BINARY,) and outcome.kept == ()
    assert (tmp_path / BINARY).read_bytes() == FILES[BINARY]


def test_a_kernel_binary_is_a_binary_suffix_beside_a_listed_source_of_the_same_stem():
    manifest = listed({**FILES, "cx/cxstem.json": b"{}", "cx/cyother.so": b"x"})
    assert artifact.kernel_sources(BINARY, manifest) == [m for m in manifest if m.relpath == SOURCE]
    assert artifact.kernel_sources("cx/cxstem.json", manifest) == []  # not a binary suffix
    assert artifact.kernel_sources("cx/cyother.so", manifest) == []  # no source of its stem
    assert artifact.kernel_sources("cy/cxstem.main.so", manifest) == []  # its source is in another dir


# ---------------------------------------------------------------- rules 3 and 1 in a shared dir


def test_unlisted_entries_in_the_shared_key_dir_do_not_refuse(tmp_path):
    """Old: refused ("holds entries for this key that rank 1 did not list")."""
    for rel, data in FILES.items():
        put(tmp_path, rel, data)
    put(tmp_path, PREFIX + "entry_of_another_process", b"another pickle of the same graph")
    assert artifact.check_shared(str(tmp_path), listed(FILES), 1) == artifact.Accepted()
    assert artifact.unlisted_entries(str(tmp_path), PREFIX, listed(FILES)) == [PREFIX + "entry_of_another_process"]


def test_a_listed_file_missing_from_the_shared_dir_refuses(tmp_path):
    for rel, data in FILES.items():
        if rel != FX:
            put(tmp_path, rel, data)
    refusal = artifact.check_shared(str(tmp_path), listed(FILES), 1)
    assert isinstance(refusal, artifact.Refusal) and not refusal.digest
    assert FX in refusal.why and "missing" in refusal.why


def test_a_listed_file_with_other_bytes_in_the_shared_dir_refuses_as_a_digest_mismatch(tmp_path):
    for rel, data in FILES.items():
        put(tmp_path, rel, data + (b" changed after its digest was taken" if rel == ENTRY else b""))
    refusal = artifact.check_shared(str(tmp_path), listed(FILES), 1)
    assert isinstance(refusal, artifact.Refusal) and refusal.digest
    assert ENTRY in refusal.why and "SHA-256" in refusal.why


def test_a_kernel_binary_with_other_bytes_beside_its_source_in_the_shared_dir_is_kept(tmp_path):
    """Old: a digest refusal. Torch's lookup and a local compile alike load that very binary."""
    for rel, data in FILES.items():
        put(tmp_path, rel, data if rel != BINARY else b"\x7fELF rebuilt here")
    assert artifact.check_shared(str(tmp_path), listed(FILES), 1) == artifact.Accepted(kept=(BINARY,))


# ---------------------------------------------------------------- rule 1: what is refused


def test_received_bytes_that_do_not_match_their_digest_refuse_and_nothing_is_written(tmp_path):
    data = b"".join(FILES.values())
    tampered = data[:3] + b"X" + data[4:]
    got, refusal = artifact.split_verified(listed(FILES), tampered, 1)
    assert got == [] and refusal is not None and refusal.digest and ENTRY in refusal.why
    assert tree(tmp_path) == {}


def test_received_bytes_that_match_their_digests_are_cut_into_the_manifests_files():
    got, refusal = artifact.split_verified(listed(FILES), b"".join(FILES.values()), 1)
    assert refusal is None and [(f.relpath, b) for f, b in got] == list(FILES.items())


def test_a_path_outside_the_cache_layout_refuses(tmp_path):
    for rel in ("../x", "/etc/passwd", "a/b/c/d/e/f/g", "aotautograd/./x", "aotautograd/.hidden"):
        assert not artifact.safe_relpath(rel)
        result = Result("ok", None, listed({ENTRY: b"e", rel: b"x"}), [])
        assert "outside the cache layout" in (artifact.manifest_problem(result, 1) or "")
        outcome = artifact.install(str(tmp_path), pieces({ENTRY: b"e", rel: b"x"}))
        assert isinstance(outcome, artifact.Refusal) and "outside the cache layout" in outcome.why
    assert tree(tmp_path) == {}


def test_an_entry_for_another_key_refuses():
    manifest = listed({ENTRY: b"e", "aotautograd/otherkey/entry0": b"o"})
    refusal = artifact.foreign_entry(manifest, PREFIX, KEY, "aot")
    assert refusal is not None and "another key" in refusal.why
    refusal = artifact.foreign_entry(listed({"aotautograd/otherkey/entry0": b"o"}), PREFIX, KEY, "aot")
    assert refusal is not None and "own key" in refusal.why


def test_a_manifest_without_an_entry_refuses():
    result = Result("ok", None, listed({FX: b"f", SOURCE: b"s"}), [])
    assert "no AOTAutograd cache entry" in (artifact.manifest_problem(result, 1) or "")


# ---------------------------------------------------------------- rule 4: torn, stale, identical


def test_a_truncated_entry_file_is_replaced_by_the_verified_bytes_atomically(tmp_path):
    """Old: refused ("exists ... with other content"): a crashed job's torn file blocked the key."""
    torn = put(tmp_path, ENTRY, FILES[ENTRY][:5])
    outcome = artifact.install(str(tmp_path), pieces())
    assert isinstance(outcome, artifact.Accepted) and outcome.replaced == (ENTRY,)
    assert torn.read_bytes() == FILES[ENTRY]
    assert staging_left(tmp_path) == []


def test_a_replaced_file_is_renamed_over_not_rewritten_in_place(tmp_path):
    """The old inode stays whole for whoever had it open: the replacement is a rename."""
    torn = put(tmp_path, ENTRY, FILES[ENTRY][:5])
    with open(torn, "rb") as reader:
        artifact.install(str(tmp_path), pieces())
        assert reader.read() == FILES[ENTRY][:5]
    assert torn.read_bytes() == FILES[ENTRY]


def test_an_existing_identical_file_is_left_as_is(tmp_path):
    same = put(tmp_path, ENTRY, FILES[ENTRY])
    before = same.stat()
    outcome = artifact.install(str(tmp_path), pieces())
    after = same.stat()
    assert isinstance(outcome, artifact.Accepted) and outcome.written == 3 and outcome.replaced == ()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_fresh_install_writes_every_file_and_leaves_no_staging(tmp_path):
    assert artifact.install(str(tmp_path), pieces()) == artifact.Accepted(written=4)
    assert tree(tmp_path) == {
        **FILES,
        **{d: b"" for d in ("aotautograd/", PREFIX, "fxgraph/", "fxgraph/ab/", "fxgraph/ab/fkey0123/", "cx/")},
    }


# ---------------------------------------------------------------- rule 5: all or nothing


def test_a_failed_install_leaves_nothing_new_behind(tmp_path):
    """A regular file where a dir must be: staged files and made dirs are removed again."""
    put(tmp_path, "fxgraph", b"a file where the fxgraph dir must be")
    before = tree(tmp_path)
    outcome = artifact.install(str(tmp_path), pieces())
    assert isinstance(outcome, artifact.Refusal) and "could not write" in outcome.why
    assert tree(tmp_path) == before


def test_a_dir_where_a_file_must_be_refuses_before_anything_is_written(tmp_path):
    (tmp_path / ENTRY).mkdir(parents=True)
    before = tree(tmp_path)
    outcome = artifact.install(str(tmp_path), pieces())
    assert isinstance(outcome, artifact.Refusal) and ENTRY in outcome.why
    assert tree(tmp_path) == before


# ---------------------------------------------------------------- collect


def test_collect_lists_entry_files_and_same_stem_kernel_files_with_their_digests(tmp_path):
    root = tmp_path / "cache"
    for rel, data in FILES.items():
        put(root, rel, data)
    put(root, "cx/cxstem.main.o", b"object")
    put(root, "cx/cyother.so", b"another kernel")  # another stem: not this compile's
    put(root, PREFIX + ".1234.5678.tmp", b"torch's half-written file")
    put(root, PREFIX + ".cc-once-1-2-0", b"our staging")
    put(root, "cx/cxstem.main.lock", b"")
    put(root, "cx/.cxstem.main.so.tmp", b"half a binary")
    put(tmp_path, "outside.so", b"outside the root")
    os.symlink(tmp_path / "outside.so", root / "fxgraph/ab/fkey0123/link")
    manifest, data = artifact.collect(
        str(root), [str(root / PREFIX), str(root / "fxgraph/ab/fkey0123")], [str(root / SOURCE)]
    )
    expected = {**FILES, "cx/cxstem.main.o": b"object"}
    assert sorted(f.relpath for f in manifest) == sorted(expected)
    assert all(f.sha256 == hashlib.sha256(expected[f.relpath]).digest() for f in manifest)
    assert all(f.size == len(expected[f.relpath]) for f in manifest)
    assert data == b"".join(expected[f.relpath] for f in manifest)


def test_what_collect_lists_installs_in_another_dir_byte_for_byte(tmp_path):
    src, dst = tmp_path / "rank0", tmp_path / "rank1"
    for rel, data in FILES.items():
        put(src, rel, data)
    manifest, data = artifact.collect(
        str(src), [str(src / PREFIX), str(src / "fxgraph/ab/fkey0123")], [str(src / SOURCE)]
    )
    got, refusal = artifact.split_verified(manifest, data, 0)
    assert refusal is None and artifact.install(str(dst), got) == artifact.Accepted(written=4)
    assert {r: b for r, b in tree(dst).items() if not r.endswith("/")} == FILES
