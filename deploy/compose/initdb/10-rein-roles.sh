#!/bin/sh
# Run by the postgres image once, when it initialises an empty data directory
# (/docker-entrypoint-initdb.d). Creates Rein's login and group roles in $POSTGRES_DB from
# /rein/rein-roles.sql with the passwords given in the environment.
# The entrypoint may source this file rather than run it: no `set -u`, no `exit`.
psql -v ON_ERROR_STOP=1 --no-psqlrc --quiet \
    --username "${POSTGRES_USER:-postgres}" --dbname "${POSTGRES_DB:?POSTGRES_DB is not set}" \
    -v dbname="${POSTGRES_DB}" \
    -v owner_password="${REIN_OWNER_PASSWORD:?REIN_OWNER_PASSWORD is not set}" \
    -v worker_password="${REIN_WORKER_PASSWORD:?REIN_WORKER_PASSWORD is not set}" \
    -v api_password="${REIN_API_PASSWORD:?REIN_API_PASSWORD is not set}" \
    -f /rein/rein-roles.sql
