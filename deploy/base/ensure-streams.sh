#!/bin/sh
# Shoal creates its stream and KV buckets when they are missing, with one replica, and leaves
# existing ones alone. On a NATS cluster they should survive the loss of a node, so this
# creates them first, replicated, with the settings Shoal itself would use (its defaults:
# SHOAL_MAX_QUEUED 10000, SHOAL_DEDUP_WINDOW 30 s; worker reports expire after 15 s).
# It runs in an init container (the nats-box image) of every Shoal pod: idempotent, and
# concurrent runs are harmless because JetStream accepts a create with an identical config.
set -eu
replicas="${SHOAL_NATS_REPLICAS:-3}"

nats stream info SHOAL_WORK >/dev/null 2>&1 || nats stream add SHOAL_WORK \
  --subjects 'shoal.work.>' \
  --storage file \
  --retention work \
  --discard new \
  --discard-per-subject \
  --max-msgs-per-subject 10000 \
  --dupe-window 30s \
  --replicas "$replicas" \
  --defaults

for bucket in shoal_models shoal_profiles; do
  nats kv info "$bucket" >/dev/null 2>&1 \
    || nats kv add "$bucket" --history 1 --replicas "$replicas"
done
nats kv info shoal_workers >/dev/null 2>&1 \
  || nats kv add shoal_workers --history 1 --ttl 15s --replicas "$replicas"
