#!/usr/bin/env bash
# cdmlfs sidecar entrypoint: serve one archive on a FUSE mount until told to stop.
#
#   1. clears a dead mount ("Transport endpoint is not connected") that a crashed
#      previous run left on the mount point;
#   2. runs `cdmlfs mount SOURCE MOUNTPOINT --foreground` with options from the
#      environment (below) plus any options given as arguments;
#   3. forwards SIGTERM/SIGINT/SIGHUP to cdmlfs, which unmounts and exits 0;
#   4. if cdmlfs dies (killed, OOM) and leaves a dead mount, clears it at once so
#      the other containers see an empty directory instead of a hung one, and
#      exits with cdmlfs's status (non-zero when the mount failed).
#
# Environment (empty means unset):
#   CDMLFS_SOURCE          archive path or URI (required)
#   CDMLFS_MOUNTPOINT      where to mount (default /mnt/data); put it *below* the
#                          shared volume (volume on /mnt, mount on /mnt/data)
#   CDMLFS_CACHE_SIZE      --cache-size, e.g. 2G
#   CDMLFS_OPTIONS         -o, e.g. allow_other
#   CDMLFS_THREADS         --threads auto|single|multi
#   CDMLFS_ENDPOINT_URL    --endpoint-url (S3-compatible stores)
#   CDMLFS_REGION          --region
#   CDMLFS_PROFILE         --profile
#   CDMLFS_NO_SIGN_REQUEST --no-sign-request when 1/true/yes/on
#   CDMLFS_INDEX_DIR       --index-dir
#   CDMLFS_VERBOSE         --verbose when 1/true/yes/on
#   CDMLFS_PID_FILE        where the daemon's pid is written for the healthcheck
#                          (default /tmp/cdmlfs-sidecar.pid)
#   CDMLFS_BIN             the cdmlfs executable (default: cdmlfs on PATH)
#   AWS_*                  read by boto3 itself (credentials, AWS_REGION, AWS_ENDPOINT_URL)
#
# A first argument that is not an option runs that command instead
# (`docker run IMAGE cdmlfs doctor`, `docker run -it IMAGE bash`).
set -u

log() { printf 'cdmlfs-entrypoint: %s\n' "$*" >&2; }

if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  exec "$@"
fi

child=""
stopping=0
# Installed before anything slow (clearing a dead mount can take seconds): as PID 1, bash ignores
# a signal it has no trap for, and a stop during start-up waited out the grace period for SIGKILL.
# shellcheck disable=SC2329  # invoked by the trap below
forward() {
  stopping=1
  if [ -n "$child" ]; then
    kill -TERM "$child" 2>/dev/null
  fi
}
trap forward TERM INT HUP

BIN=${CDMLFS_BIN:-cdmlfs}
SOURCE=${CDMLFS_SOURCE:-}
MNT=${CDMLFS_MOUNTPOINT:-/mnt/data}

if [ -z "$SOURCE" ]; then
  log "CDMLFS_SOURCE is not set (an archive path or URI, e.g. /archives/train.zip)"
  exit 2
fi

truthy() {
  case "${1,,}" in
    1 | true | yes | on) return 0 ;;
    *) return 1 ;;
  esac
}

# True when MNT holds a FUSE mount whose daemon is gone. statfs always reaches
# the daemon (a stat of the root may come from the kernel's attribute cache).
is_dead() {
  local err
  if err=$(LC_ALL=C timeout -k 1 10 stat -f -c %T -- "$1" 2>&1 >/dev/null); then
    return 1
  fi
  case "$err" in
    *"not connected"*) return 0 ;;
    *) return 1 ;;
  esac
}

# Unmount dead mounts on MNT (several may be stacked after repeated crashes).
# Only dead ones: a live mount belongs to a running daemon and is left alone
# (cdmlfs mount then refuses the mount point with its own message).
clear_dead_mounts() {
  local i
  for i in 1 2 3 4 5 6 7 8; do
    is_dead "$MNT" || return 0
    log "clearing a dead mount on $MNT left by a previous run (try $i)"
    "$BIN" umount "$MNT" || log "cdmlfs umount $MNT failed"
  done
  if is_dead "$MNT"; then
    log "could not clear the dead mount on $MNT"
    return 1
  fi
}

clear_dead_mounts || exit 1
if [ "$stopping" = 1 ]; then
  log "stopped before mounting"
  exit 0
fi
if ! mkdir -p -- "$MNT"; then
  log "cannot create the mount point $MNT"
  exit 1
fi

args=(mount "$SOURCE" "$MNT" --foreground)
# --opt=VALUE: a value starting with "-" (a typo such as -5M) is then an error about the value.
[ -n "${CDMLFS_CACHE_SIZE:-}" ] && args+=("--cache-size=$CDMLFS_CACHE_SIZE")
[ -n "${CDMLFS_OPTIONS:-}" ] && args+=(-o "$CDMLFS_OPTIONS")
[ -n "${CDMLFS_THREADS:-}" ] && args+=("--threads=$CDMLFS_THREADS")
[ -n "${CDMLFS_ENDPOINT_URL:-}" ] && args+=("--endpoint-url=$CDMLFS_ENDPOINT_URL")
[ -n "${CDMLFS_REGION:-}" ] && args+=("--region=$CDMLFS_REGION")
[ -n "${CDMLFS_PROFILE:-}" ] && args+=("--profile=$CDMLFS_PROFILE")
[ -n "${CDMLFS_INDEX_DIR:-}" ] && args+=("--index-dir=$CDMLFS_INDEX_DIR")
truthy "${CDMLFS_NO_SIGN_REQUEST:-}" && args+=(--no-sign-request)
truthy "${CDMLFS_VERBOSE:-}" && args+=(--verbose)
args+=("$@")

PIDFILE=${CDMLFS_PID_FILE:-/tmp/cdmlfs-sidecar.pid}
rm -f -- "$PIDFILE" "$PIDFILE.busy" 2>/dev/null # a previous run's (killed with its container)
# The command line carries no secrets (credentials stay in the environment).
log "running: $(printf '%q ' "$BIN" "${args[@]}")"
"$BIN" "${args[@]}" &
child=$!
# The healthcheck tells a busy daemon from a hung one by the CPU this pid uses.
{ echo "$child" >"$PIDFILE"; } 2>/dev/null || log "cannot write $PIDFILE: the healthcheck cannot tell busy from hung"
# A signal that arrived before $child was known.
[ "$stopping" = 1 ] && kill -TERM "$child" 2>/dev/null

# `wait` returns early (status > 128) each time a trapped signal arrives; keep
# waiting until cdmlfs itself has exited, then take its real status.
while :; do
  wait "$child"
  rc=$?
  if [ "$rc" -gt 128 ] && kill -0 "$child" 2>/dev/null; then
    continue
  fi
  if [ "$rc" -gt 128 ]; then
    wait "$child" 2>/dev/null
    late=$?
    [ "$late" -ne 127 ] && rc=$late
  fi
  break
done
trap - TERM INT HUP
rm -f -- "$PIDFILE" "$PIDFILE.busy" 2>/dev/null

if is_dead "$MNT"; then
  log "cdmlfs exited (status $rc) leaving a dead mount on $MNT; clearing it"
  "$BIN" umount "$MNT" || log "cdmlfs umount $MNT failed"
fi
if [ "$rc" -eq 0 ]; then
  log "unmounted $MNT"
else
  log "cdmlfs exited with status $rc"
fi
exit "$rc"
