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
#     seconds (default 5): a hung daemon. Unless the daemon is busy: a local
#     mount serves one request at a time, and the first read of a multi-GB
#     deflate or bzip2 member decodes for seconds a GB; a statfs behind it
#     waits. When the entrypoint left the daemon's pid ($CDMLFS_PID_FILE), a
#     daemon that used at least a tenth of a CPU during the wait (and is not
#     stopped) passes as busy, for up to $CDMLFS_HEALTH_BUSY_MAX seconds in a
#     row (default 900); past that it fails too.
set -u

MNT=${1:-${CDMLFS_MOUNTPOINT:-/mnt/data}}
LIMIT=${CDMLFS_HEALTH_TIMEOUT:-5}
PIDFILE=${CDMLFS_PID_FILE:-/tmp/cdmlfs-sidecar.pid}
BUSY_MAX=${CDMLFS_HEALTH_BUSY_MAX:-900}

fail() {
  rm -f -- "$PIDFILE.busy" 2>/dev/null
  printf 'cdmlfs-healthcheck: %s: %s\n' "$MNT" "$*" >&2
  exit 1
}

# Numbers from the environment, checked (a typo must not turn "hung" into "busy" for ever).
case "$LIMIT" in
  "" | *[!0-9.]* | *.*.* | .) fail "CDMLFS_HEALTH_TIMEOUT=$LIMIT: not a number of seconds" ;;
esac
# 0 would be no limit at all for timeout(1): a hung mount would hang the probe.
awk -v l="$LIMIT" 'BEGIN { exit !(l > 0) }' || fail "CDMLFS_HEALTH_TIMEOUT=$LIMIT: must be more than 0"
case "$BUSY_MAX" in
  "" | *[!0-9]*) fail "CDMLFS_HEALTH_BUSY_MAX=$BUSY_MAX: not a whole number of seconds" ;;
esac

# "CPU-ticks STATE" of the daemon whose pid the entrypoint wrote, or nothing.
daemon_cpu() {
  local pid="" stat
  [ -r "$PIDFILE" ] && read -r pid _ <"$PIDFILE" 2>/dev/null
  [ -n "$pid" ] || return 1
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  stat=${stat##*) } # after the command name (which may hold spaces): state is first, utime 12th
  # shellcheck disable=SC2086  # split into fields on purpose
  set -- $stat
  echo "$((${12} + ${13})) $1"
}

# Did statfs (or the listing) wait on a busy daemon rather than a hung one? $1: daemon_cpu before.
busy() {
  local before=$1 now since
  [ -n "$before" ] || return 1
  now=$(daemon_cpu) || return 1
  case "${now#* }" in T | t | Z | X) return 1 ;; esac # stopped or gone: not busy
  # At least a tenth of a CPU during the wait (LIMIT may have decimals: awk does the arithmetic).
  awk -v used="$((${now% *} - ${before% *}))" -v limit="$LIMIT" -v hz="$(getconf CLK_TCK)" \
    'BEGIN { exit !(used >= limit * hz / 10) }' || return 1
  since=$(cat -- "$PIDFILE.busy" 2>/dev/null) || since=""
  case "$since" in "" | *[!0-9]*) since="" ;; esac
  if [ -z "$since" ]; then
    since=$(date +%s)
    # Unrecorded, every probe would start a new streak: busy for ever. So not busy then.
    { echo "$since" >"$PIDFILE.busy"; } 2>/dev/null || return 1
  fi
  if [ $(($(date +%s) - since)) -gt "$BUSY_MAX" ]; then
    fail "busy without answering for over ${BUSY_MAX}s (CDMLFS_HEALTH_BUSY_MAX)"
  fi
  echo "cdmlfs-healthcheck: $MNT: busy (a request held it past ${LIMIT}s; the daemon is working)"
  exit 0
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
before=$(daemon_cpu) || before=""
if ! err=$(LC_ALL=C timeout -k 1 "$LIMIT" stat -f -c %T -- "$MNT" 2>&1 >/dev/null); then
  case "$err" in
    *"not connected"*) fail "dead mount: Transport endpoint is not connected (the daemon is gone)" ;;
    "") busy "$before" || fail "no answer to statfs within ${LIMIT}s (daemon hung?)" ;;
    *) fail "statfs failed: $err" ;;
  esac
fi

# A listing of the root exercises lookup/readdir in the daemon.
before=$(daemon_cpu) || before=""
if ! err=$(LC_ALL=C timeout -k 1 "$LIMIT" ls -f -- "$MNT" 2>&1 >/dev/null); then
  [ -z "$err" ] && busy "$before"
  fail "listing failed: ${err:-no answer within ${LIMIT}s}"
fi

rm -f -- "$PIDFILE.busy" 2>/dev/null
echo "cdmlfs-healthcheck: $MNT: healthy ($fstype)"
