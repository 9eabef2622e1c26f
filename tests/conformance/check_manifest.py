"""Checks the conformance data against its manifest: every file listed has the SHA-256 the
manifest gives, and every file under the data folder is listed. The data is a byte-for-byte
copy of public conformance data; it is never edited (a change fails here).

Usage: python3 check_manifest.py DATA_DIR   (DATA_DIR holds MANIFEST.sha256)
"""
import hashlib
import os
import sys


def main(data_dir):
    manifest = os.path.join(data_dir, "MANIFEST.sha256")
    listed = {}
    with open(manifest, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line:
                continue
            digest, sep, name = line.partition("  ")
            if not sep or len(digest) != 64:
                print(f"{manifest}:{number}: not '<sha256>  <path>'")
                return 1
            listed[name] = digest
    problems = []
    for name, digest in sorted(listed.items()):
        path = os.path.join(data_dir, name)
        try:
            with open(path, "rb") as f:
                got = hashlib.sha256(f.read()).hexdigest()
        except OSError as e:
            problems.append(f"{name}: {e.strerror}")
            continue
        if got != digest:
            problems.append(f"{name}: SHA-256 {got}, the manifest says {digest}")
    for root, _, files in os.walk(data_dir):
        for fn in files:
            rel = os.path.relpath(os.path.join(root, fn), data_dir)
            if rel != "MANIFEST.sha256" and rel not in listed:
                problems.append(f"{rel}: not in the manifest")
    for p in problems:
        print(p)
    print(f"{len(listed)} files listed, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
