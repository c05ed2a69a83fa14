#!/usr/bin/env bash
# Export the HEAD tree of a bare/no-worktree git snapshot to a directory,
# skipping blobs that are absent from the object store (e.g. large files
# not fetched). Preserves executable bits and symlinks.
# Usage: export_comfyui.sh <git-dir> <dest-dir> [rev]
# Developer-only helper: CI does not run it (it has no ComfyUI snapshot).
set -euo pipefail
gitdir=${1:?git dir}
dest=${2:?destination dir}
rev=${3:-HEAD}
git --git-dir="$gitdir" rev-parse --verify -q "$rev^{tree}" >/dev/null \
  || { echo "not a git dir or bad rev: $gitdir $rev" >&2; exit 2; }
mkdir -p "$dest"
missing=0
while IFS=$'\t' read -r meta path; do
  read -r mode type sha <<<"$meta"
  [ "$type" = blob ] || continue
  out="$dest/$path"
  mkdir -p "$(dirname "$out")"
  if ! git --git-dir="$gitdir" cat-file -e "$sha" 2>/dev/null; then
    echo "skip (blob missing): $path" >&2
    missing=$((missing + 1))
    continue
  fi
  if [ "$mode" = 120000 ]; then
    ln -sfn "$(git --git-dir="$gitdir" cat-file blob "$sha")" "$out"
    continue
  fi
  git --git-dir="$gitdir" cat-file blob "$sha" >"$out"
  if [ "$mode" = 100755 ]; then chmod 755 "$out"; else chmod 644 "$out"; fi
done < <(git --git-dir="$gitdir" ls-tree -r --full-tree "$rev")
git --git-dir="$gitdir" rev-parse "$rev" >"$dest/.exported_from_commit"
echo "exported $rev to $dest ($missing missing blobs skipped)" >&2
