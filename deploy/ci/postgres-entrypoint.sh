#!/bin/sh
# The official postgres image's contract, the part docker-compose.yml uses: a first start initialises
# $PGDATA with superuser $POSTGRES_USER (password $POSTGRES_PASSWORD) and creates $POSTGRES_DB; local socket
# connections are trusted (the socket is in /var/run/postgresql and in /tmp, where these binaries look by
# default), TCP ones need the password (scram-sha-256); the server listens on every address.
set -eu
: "${POSTGRES_PASSWORD:?POSTGRES_PASSWORD is required}"
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
  initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
    --encoding=UTF8 --no-instructions >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
  if [ "$db" != postgres ]; then
    echo "CREATE DATABASE \"$db\" OWNER \"$user\";" | postgres --single -D "$PGDATA" -j postgres >/dev/null
  fi
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' -c unix_socket_directories=/var/run/postgresql,/tmp "$@"
