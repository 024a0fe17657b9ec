#!/bin/sh
# Create a Redis Cluster of the nodes named as arguments (HOST or HOST:PORT, port 6379 by
# default), one replica per master, unless it exists already. The password comes from
# REDISCLI_AUTH (never on the command line). Used by compose.redis-cluster.yaml and, as a
# ConfigMap, by the Kubernetes overlay deploy/k8s/overlays/redis-cluster.
# REPLICAS: replicas per master (default 1): the node count must be (REPLICAS + 1) x masters,
# at least 3 masters.
set -eu
replicas="${REPLICAS:-1}"
first="${1%%:*}"
first_port="${1##*:}"; [ "$first_port" = "$1" ] && first_port=6379

# Each node must answer before the cluster is created (a Job may start before the pods).
for node in "$@"; do
    host="${node%%:*}"; port="${node##*:}"; [ "$port" = "$node" ] && port=6379
    tries=0
    until redis-cli -h "$host" -p "$port" ping 2>/dev/null | grep -q PONG; do
        tries=$((tries + 1))
        [ "$tries" -ge 150 ] && { echo "$host:$port does not answer" >&2; exit 1; }
        sleep 2
    done
done

if redis-cli -h "$first" -p "$first_port" cluster info | grep -q '^cluster_state:ok'; then
    echo "the cluster exists: nothing to do"
    exit 0
fi

# CLUSTER MEET takes IP addresses, not names: resolve each node here.
addresses=""
for node in "$@"; do
    host="${node%%:*}"; port="${node##*:}"; [ "$port" = "$node" ] && port=6379
    ip="$(getent hosts "$host" | awk '{print $1; exit}')"
    [ -n "$ip" ] || { echo "cannot resolve $host" >&2; exit 1; }
    addresses="$addresses $ip:$port"
done
# shellcheck disable=SC2086  # one argument per address
redis-cli --cluster create $addresses --cluster-replicas "$replicas" --cluster-yes

# Wait until the nodes agree (qcluster's client needs every hash slot covered).
tries=0
until redis-cli -h "$first" -p "$first_port" cluster info | grep -q '^cluster_state:ok'; do
    tries=$((tries + 1))
    [ "$tries" -ge 60 ] && { echo "the cluster did not reach cluster_state:ok" >&2; exit 1; }
    sleep 1
done
# And until each replica has synced: before that a publish's WAIT finds no replica and
# qcluster refuses it (the jobs could be lost in a failover).
for node in "$@"; do
    host="${node%%:*}"; port="${node##*:}"; [ "$port" = "$node" ] && port=6379
    tries=0
    until redis-cli -h "$host" -p "$port" info replication \
            | grep -Eq '^(role:master|master_link_status:up)'; do
        tries=$((tries + 1))
        [ "$tries" -ge 120 ] && { echo "$host:$port did not sync with its master" >&2; exit 1; }
        sleep 1
    done
done
echo "cluster created:$addresses"
