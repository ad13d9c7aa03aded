#!/usr/bin/env bash
# Health of the cdmlfs mount: exit 0 only when a live FUSE mount answers on it.
#
#   cdmlfs-healthcheck [MOUNTPOINT]     (default: $CDMLFS_MOUNTPOINT, else /mnt/data)
#
# Fails (exit 1, one line on stderr) when
#   - the top-most mount on MOUNTPOINT in /proc/self/mountinfo is not FUSE
#     (not mounted yet, or unmounted);
#   - statfs fails: "Transport endpoint is not connected" means the daemon died
#     and left a dead mount;
#   - statfs or a directory listing takes longer than $CDMLFS_HEALTH_TIMEOUT
#     seconds (default 5): a hung daemon.
set -u

MNT=${1:-${CDMLFS_MOUNTPOINT:-/mnt/data}}
LIMIT=${CDMLFS_HEALTH_TIMEOUT:-5}

fail() {
  printf 'cdmlfs-healthcheck: %s: %s\n' "$MNT" "$*" >&2
  exit 1
}

# Compare as mountinfo writes paths: absolute, normalised, with space, tab,
# newline and backslash escaped as \ooo. `realpath -ms` only rewrites the
# string; it never touches a (possibly hung) file system.
target=$(realpath -ms -- "$MNT") || fail "bad path"
target=${target//\\/\\134}
target=${target// /\\040}
target=${target//$'\t'/\\011}
target=${target//$'\n'/\\012}

# The last entry for a mount point is the top-most one (what a path lookup reaches).
fstype=$(HC_TARGET="$target" awk '
  $5 == ENVIRON["HC_TARGET"] {
    for (i = 7; i <= NF; i++) if ($i == "-") { t = $(i + 1); break }
  }
  END { print t }' /proc/self/mountinfo) || fail "cannot read /proc/self/mountinfo"

case "$fstype" in
  fuse | fuse.* | fuseblk) ;;
  "") fail "nothing is mounted here" ;;
  *) fail "top-most mount is $fstype, not FUSE (cdmlfs not mounted)" ;;
esac

# statfs always goes to the daemon.
if ! err=$(LC_ALL=C timeout -k 1 "$LIMIT" stat -f -c %T -- "$MNT" 2>&1 >/dev/null); then
  case "$err" in
    *"not connected"*) fail "dead mount: Transport endpoint is not connected (the daemon is gone)" ;;
    "") fail "no answer to statfs within ${LIMIT}s (daemon hung?)" ;;
    *) fail "statfs failed: $err" ;;
  esac
fi

# A listing of the root exercises lookup/readdir in the daemon.
if ! err=$(LC_ALL=C timeout -k 1 "$LIMIT" ls -f -- "$MNT" 2>&1 >/dev/null); then
  fail "listing failed: ${err:-no answer within ${LIMIT}s}"
fi

echo "cdmlfs-healthcheck: $MNT: healthy ($fstype)"
