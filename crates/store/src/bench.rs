//! Queries behind `rein bench`: progress and latency of one benchmark queue, the database's
//! transaction counter, and a scratch table for the database's own insert rate (the
//! reference every Rein figure is compared with).

use serde::Serialize;

use crate::{Store, StoreError};

/// p50/p90/p99 of a latency in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub samples: i64,
}

/// What the runs of one benchmark queue did, measured by the database clock.
#[derive(Debug, Clone, Default, Serialize)]
pub struct QueueStats {
    pub runs: i64,
    pub runs_terminal: i64,
    /// Every event of the queue's runs.
    pub events: i64,
    /// Events that complete a step: every type but the engine's own records.
    pub steps: i64,
    /// From the first claim to the last event, in seconds.
    pub span_s: f64,
    /// Run creation to its first claim.
    pub enqueue_to_start_ms: Percentiles,
    /// Claim (or previous step) to the event that completes the next step.
    pub step_ms: Percentiles,
}

/// The queue's runs are read from `$3` on, a range of the primary key (run ids are UUIDv7,
/// ordered by creation), not by a scan of every run the database holds; every lookup of
/// events and grants goes through their run_id indexes (LATERAL; OFFSET 0 keeps the planner
/// from flattening it into a scan of every event). So the cost follows the queue's size,
/// not the database's, whatever the planner believes about a queue it has no statistics
/// for yet.
const QUEUE_STATS: &str = "
WITH runs AS MATERIALIZED (
    SELECT run_id, created_at, status FROM rein_runs WHERE run_id >= $3 AND queue = $1
), ev AS MATERIALIZED (
    SELECT e.run_id, e.type, e.occurred_at
    FROM runs, LATERAL (SELECT x.run_id, x.type, x.occurred_at FROM rein_events x
                        WHERE x.run_id = runs.run_id OFFSET 0) e
), first_claim AS MATERIALIZED (
    SELECT runs.run_id, g.at
    FROM runs, LATERAL (SELECT min(x.granted_at) AS at FROM rein_lease_grants x
                        WHERE x.run_id = runs.run_id) g
    WHERE g.at IS NOT NULL
), marks AS (
    SELECT run_id, occurred_at AS at FROM ev WHERE type <> ALL($2::text[])
    UNION ALL
    SELECT run_id, at FROM first_claim
), gaps AS (
    SELECT extract(epoch FROM at - lag(at) OVER (PARTITION BY run_id ORDER BY at)) * 1000 AS ms
    FROM marks
), starts AS (
    SELECT extract(epoch FROM f.at - r.created_at) * 1000 AS ms
    FROM first_claim f JOIN runs r USING (run_id)
)
SELECT
    (SELECT count(*) FROM runs),
    (SELECT count(*) FROM runs WHERE status = 'terminal'),
    (SELECT count(*) FROM ev),
    (SELECT count(*) FROM ev WHERE type <> ALL($2::text[])),
    COALESCE((SELECT extract(epoch FROM (SELECT max(occurred_at) FROM ev) - min(at))
              FROM first_claim), 0)::float8,
    (SELECT percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY ms) FROM starts),
    (SELECT count(*) FROM starts),
    (SELECT percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY ms) FROM gaps
     WHERE ms IS NOT NULL),
    (SELECT count(*) FROM gaps WHERE ms IS NOT NULL)";

fn percentiles(values: Option<Vec<f64>>, samples: i64) -> Percentiles {
    let v = values.unwrap_or_default();
    let at = |i: usize| v.get(i).copied().unwrap_or(0.0);
    Percentiles {
        p50: at(0),
        p90: at(1),
        p99: at(2),
        samples,
    }
}

/// The smallest run id (UUIDv7) created at `at` or later: its 48-bit time prefix is `at` in
/// milliseconds and every other bit but the version and variant is 0. A branch's child
/// carries its parent's time prefix ([`rein_core::join::child_run_id`]), so it is at or
/// after its root's bound too.
pub fn first_run_id_at(at: std::time::SystemTime) -> uuid::Uuid {
    let ms = at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    uuid::Builder::from_unix_timestamp_millis(ms, &[0u8; 10]).into_uuid()
}

/// Rejects anything but a plain lower-case identifier, so it can be spliced into DDL.
fn scratch_ident(name: &str) -> Result<&str, StoreError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(name)
    } else {
        Err(StoreError::Invalid(format!(
            "scratch table name `{name}` must be a lower-case identifier"
        )))
    }
}

impl Store {
    /// Runs of `queue` whose ids are `since` or later: (all, terminal). Run ids are UUIDv7,
    /// ordered by creation time, so `since` (see [`first_run_id_at`]) bounds the read to a
    /// range of the primary key: the runs created since then, not every run the database
    /// has ever held. A benchmark asks this every few seconds while it measures; over a
    /// million finished runs, a scan by queue took ~0.9 s of the database's CPU each time.
    pub async fn queue_progress(
        &self,
        queue: &str,
        since: uuid::Uuid,
    ) -> Result<(i64, i64), StoreError> {
        Ok(sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE status = 'terminal')
             FROM rein_runs WHERE run_id >= $2 AND queue = $1",
        )
        .bind(queue)
        .bind(since)
        .fetch_one(self.pool())
        .await?)
    }

    /// Throughput and latency of the runs of `queue` whose ids are `since` or later; see
    /// [`QueueStats`].
    pub async fn queue_stats(
        &self,
        queue: &str,
        since: uuid::Uuid,
    ) -> Result<QueueStats, StoreError> {
        let engine: Vec<&str> = rein_core::EngineEvent::ALL
            .iter()
            .map(|e| e.as_str())
            .collect();
        #[allow(clippy::type_complexity)]
        let row: (
            i64,
            i64,
            i64,
            i64,
            f64,
            Option<Vec<f64>>,
            i64,
            Option<Vec<f64>>,
            i64,
        ) = sqlx::query_as(QUEUE_STATS)
            .bind(queue)
            .bind(&engine)
            .bind(since)
            .fetch_one(self.pool())
            .await?;
        Ok(QueueStats {
            runs: row.0,
            runs_terminal: row.1,
            events: row.2,
            steps: row.3,
            span_s: row.4,
            enqueue_to_start_ms: percentiles(row.5, row.6),
            step_ms: percentiles(row.7, row.8),
        })
    }

    /// Transactions committed plus rolled back in this database so far. The statistics are
    /// flushed about once a second; callers wait that long before reading.
    pub async fn transactions_so_far(&self) -> Result<i64, StoreError> {
        let mut conn = self.pool().acquire().await?;
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&mut *conn)
            .await?;
        Ok(sqlx::query_scalar(
            "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database
             WHERE datname = current_database()",
        )
        .fetch_one(&mut *conn)
        .await?)
    }

    /// Connections open right now from processes with these ids (they name themselves
    /// `rein-PID` or `rein-PID-s...`).
    pub async fn connections_of(&self, pids: &[u32]) -> Result<i64, StoreError> {
        let names: Vec<String> = pids
            .iter()
            .map(|p| crate::application_name_of(*p))
            .collect();
        Ok(sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity, unnest($1::text[]) AS n(name)
             WHERE application_name = n.name OR application_name LIKE n.name || '-%'",
        )
        .bind(&names)
        .fetch_one(self.pool())
        .await?)
    }

    /// The server's value of a run-time setting (e.g. `synchronous_commit`).
    pub async fn setting(&self, name: &str) -> Result<String, StoreError> {
        Ok(sqlx::query_scalar("SELECT current_setting($1)")
            .bind(name)
            .fetch_one(self.pool())
            .await?)
    }

    /// Creates (afresh) a scratch table shaped like a small event row.
    pub async fn scratch_create(&self, table: &str) -> Result<(), StoreError> {
        let t = scratch_ident(table)?;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {t}")))
            .execute(self.pool())
            .await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {t} (
                id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                run_id uuid NOT NULL,
                payload jsonb NOT NULL,
                at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )))
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// One transaction inserting `rows` rows into the scratch table (one statement).
    pub async fn scratch_insert(&self, table: &str, rows: usize) -> Result<(), StoreError> {
        let t = scratch_ident(table)?;
        if rows == 1 {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {t} (run_id, payload) VALUES ($1, $2)"
            )))
            .bind(uuid::Uuid::now_v7())
            .bind(serde_json::json!({ "step": 1, "ok": true }))
            .execute(self.pool())
            .await?;
        } else {
            let ids: Vec<uuid::Uuid> = (0..rows).map(|_| uuid::Uuid::now_v7()).collect();
            let payloads: Vec<serde_json::Value> = (0..rows)
                .map(|i| serde_json::json!({ "step": i, "ok": true }))
                .collect();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {t} (run_id, payload) SELECT * FROM unnest($1::uuid[], $2::jsonb[])"
            )))
            .bind(&ids)
            .bind(&payloads)
            .execute(self.pool())
            .await?;
        }
        Ok(())
    }

    /// A run of `queue` in `status`, to copy with [`Store::copy_runs`].
    pub async fn template_run(
        &self,
        queue: &str,
        status: &str,
    ) -> Result<Option<uuid::Uuid>, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT run_id FROM rein_runs WHERE queue = $1 AND status = $2 AND lease_owner IS NULL
             ORDER BY created_at LIMIT 1",
        )
        .bind(queue)
        .bind(status)
        .fetch_optional(self.pool())
        .await?)
    }

    /// Copies `copy.template` (its row, log, grants, ledger, checkpoints and approval
    /// requests) as copies `copy.first..=copy.last` into `copy.queue`, in one statement;
    /// returns how many runs it wrote. Only `rein bench` fills a database this way.
    pub async fn copy_runs(&self, copy: &RunCopies<'_>) -> Result<u64, StoreError> {
        if copy.last < copy.first {
            return Ok(0);
        }
        let n: i64 = sqlx::query_scalar(include_str!("../queries/copy_runs.sql"))
            .bind(copy.template)
            .bind(copy.salt)
            .bind(copy.first)
            .bind(copy.last)
            .bind(copy.created_from)
            .bind(copy.created_every_ms)
            .bind(copy.due_every)
            .bind(copy.queue)
            .fetch_one(self.pool())
            .await?;
        Ok(n as u64)
    }

    /// Vacuums and analyzes the tables a backlog fills: what autovacuum would have done to
    /// a month of history by now (visibility map set, hint bits written, statistics fresh).
    /// Left to autovacuum, a bulk load's first pass over every page it wrote comes within a
    /// minute, in the middle of whatever is measured next.
    pub async fn settle_filled_tables(&self) -> Result<(), StoreError> {
        sqlx::query(
            "VACUUM (ANALYZE) rein_runs, rein_events, rein_lease_grants, rein_actions, rein_approvals",
        )
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// Writes out every dirty page now (`CHECKPOINT`; superuser or `pg_checkpoint`): what
    /// the checkpointer would have done to a month of history long before. A bulk load's
    /// gigabytes of WAL otherwise set off checkpoints back to back, and the one under way
    /// when the next point starts makes its first write to every page a full-page image.
    pub async fn checkpoint(&self) -> Result<(), StoreError> {
        sqlx::query("CHECKPOINT").execute(self.pool()).await?;
        Ok(())
    }

    /// How long reading each of `runs`' history took, in microseconds, and the events read.
    pub async fn time_history_reads(
        &self,
        runs: &[uuid::Uuid],
    ) -> Result<(Vec<f64>, usize), StoreError> {
        let mut times = Vec::with_capacity(runs.len());
        let mut events = 0;
        for run in runs {
            let start = std::time::Instant::now();
            events += self.history(*run).await?.len();
            times.push(start.elapsed().as_secs_f64() * 1e6);
        }
        Ok((times, events))
    }

    /// Up to `n` runs of `queue`: from a 1% sample of the table's pages (spread over a large
    /// queue), else the newest.
    pub async fn sample_runs(&self, queue: &str, n: i64) -> Result<Vec<uuid::Uuid>, StoreError> {
        let sampled: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT run_id FROM rein_runs TABLESAMPLE SYSTEM (1) WHERE queue = $1 LIMIT $2",
        )
        .bind(queue)
        .bind(n)
        .fetch_all(self.pool())
        .await?;
        if sampled.len() as i64 * 2 >= n {
            return Ok(sampled);
        }
        Ok(sqlx::query_scalar(
            "SELECT run_id FROM rein_runs WHERE queue = $1 ORDER BY created_at DESC LIMIT $2",
        )
        .bind(queue)
        .bind(n)
        .fetch_all(self.pool())
        .await?)
    }

    /// Rows and on-disk bytes of the tables a backlog fills (with their indexes).
    pub async fn table_sizes(&self) -> Result<Vec<(String, i64, i64)>, StoreError> {
        Ok(sqlx::query_as(
            // A partitioned table's size and rows are its partitions'.
            "SELECT c.relname::text, sum(GREATEST(p.reltuples, 0))::bigint,
                    sum(pg_total_relation_size(p.oid))::bigint AS bytes
             FROM pg_class c
             JOIN pg_class p
               ON (c.relkind <> 'p' AND p.oid = c.oid)
               OR (c.relkind = 'p'
                   AND p.oid IN (SELECT relid FROM pg_partition_tree(c.oid) WHERE isleaf))
             WHERE c.relname IN ('rein_runs', 'rein_events', 'rein_lease_grants', 'rein_actions',
                                 'rein_approvals')
               AND c.relnamespace = current_schema()::regnamespace
             GROUP BY c.relname
             ORDER BY bytes DESC",
        )
        .fetch_all(self.pool())
        .await?)
    }

    pub async fn scratch_drop(&self, table: &str) -> Result<(), StoreError> {
        let t = scratch_ident(table)?;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {t}")))
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Creates (afresh) the scratch tables of the floor (`{prefix}_runs` shaped and indexed
    /// like `rein_runs`, `{prefix}_events` with the event log's columns and both its keys)
    /// and `runs` leased runs in them; returns their ids, in id order, and the projection
    /// each step writes: the newest finished run's, so it has the size a real one has.
    pub async fn floor_create(
        &self,
        prefix: &str,
        runs: usize,
    ) -> Result<(Vec<uuid::Uuid>, serde_json::Value), StoreError> {
        let p = scratch_ident(prefix)?;
        self.floor_drop(prefix).await?;
        for ddl in [
            format!(
                "CREATE TABLE {p}_runs (LIKE rein_runs INCLUDING DEFAULTS INCLUDING CONSTRAINTS
                                        INCLUDING INDEXES)"
            ),
            // LIKE does not copy a partitioned table's keys: they are declared here.
            format!(
                "CREATE TABLE {p}_events (LIKE rein_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS,
                                          PRIMARY KEY (run_id, sequence), UNIQUE (run_id, event_id))"
            ),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(ddl))
                .execute(self.pool())
                .await?;
        }
        // rein_runs' storage parameters (its fillfactor decides whether a step's update is
        // HOT), which LIKE does not copy.
        let options: Vec<String> = sqlx::query_scalar(
            "SELECT unnest(reloptions) FROM pg_class WHERE oid = 'rein_runs'::regclass",
        )
        .fetch_all(self.pool())
        .await?;
        let plain = |o: &String| {
            o.split_once('=').is_some_and(|(k, v)| {
                k.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                    && v.chars().all(|c| c.is_ascii_alphanumeric() || c == '.')
            })
        };
        if !options.is_empty() && options.iter().all(plain) {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "ALTER TABLE {p}_runs SET ({})",
                options.join(", ")
            )))
            .execute(self.pool())
            .await?;
        }
        let projection: serde_json::Value = sqlx::query_scalar(
            "SELECT projection FROM rein_runs WHERE status = 'terminal'
             ORDER BY created_at DESC LIMIT 1",
        )
        .fetch_optional(self.pool())
        .await?
        .unwrap_or_else(|| serde_json::json!({}));
        let mut ids: Vec<uuid::Uuid> = (0..runs).map(|_| uuid::Uuid::now_v7()).collect();
        ids.sort();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {p}_runs (run_id, definition, version, state, status, projection,
                                   fencing_token, lease_owner, lease_until)
             SELECT id, 'floor', 1, 'step', 'runnable', $2, 1, 'floor',
                    clock_timestamp() + interval '1 day'
             FROM unnest($1::uuid[]) AS id"
        )))
        .bind(&ids)
        .bind(sqlx::types::Json(&projection))
        .execute(self.pool())
        .await?;
        // Statistics before the first statement is planned, as Rein's tables have them
        // (rein_first_statistics): a generic plan made on a never-analyzed table may scan it.
        sqlx::query(sqlx::AssertSqlSafe(format!("ANALYZE {p}_runs, {p}_events")))
            .execute(self.pool())
            .await?;
        Ok((ids, projection))
    }

    /// One statement of a floor shape on the tables `statement` names: event `sequence` of
    /// each of `runs` (every earlier one is written). Err if any run's event was not written.
    pub async fn floor_step(
        &self,
        statement: &FloorStatement,
        runs: &[uuid::Uuid],
        sequence: i64,
        projection: &serde_json::Value,
    ) -> Result<(), StoreError> {
        let shape = statement.shape;
        if statement.life.is_some() {
            return Err(StoreError::Invalid(format!(
                "{shape:?} is a run's life, measured by floor_life"
            )));
        }
        let projections = (shape == FloorShape::Projection)
            .then(|| vec![sqlx::types::Json(projection); runs.len()]);
        self.floor_write(
            &statement.sql,
            runs,
            sequence,
            (None, projections.as_deref()),
            &format!("{shape:?} statement"),
        )
        .await
    }

    /// Writes event `sequence` of each of `runs` with a floor statement (`$1` the runs, `$2`
    /// the sequence, `$3` the event ids, `$4` the payloads, then the token and the
    /// projections when given); Err, naming `what`, when any run's event was not written.
    async fn floor_write(
        &self,
        sql: &str,
        runs: &[uuid::Uuid],
        sequence: i64,
        (token, projections): (
            Option<i64>,
            Option<&[sqlx::types::Json<&serde_json::Value>]>,
        ),
        what: &str,
    ) -> Result<(), StoreError> {
        let event_ids: Vec<uuid::Uuid> = runs.iter().map(|_| uuid::Uuid::now_v7()).collect();
        let payloads: Vec<sqlx::types::Json<serde_json::Value>> = (0..runs.len())
            .map(|i| sqlx::types::Json(serde_json::json!({ "step": i, "ok": true })))
            .collect();
        let mut query = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .bind(runs)
            .bind(sequence)
            .bind(&event_ids)
            .bind(&payloads);
        if let Some(token) = token {
            query = query.bind(token);
        }
        if let Some(projections) = projections {
            query = query.bind(projections);
        }
        let written: i64 = query.fetch_one(self.pool()).await?;
        if written != runs.len() as i64 {
            return Err(StoreError::Corrupt(format!(
                "the floor's {what} wrote {written} of {} events at sequence {sequence}",
                runs.len()
            )));
        }
        Ok(())
    }

    /// Life `life` (from 1) of `runs` in [`FloorShape::FencedRun`]'s statement: their claim
    /// (at the first life, after putting them in a queue of their own), then
    /// [`FLOOR_EVENTS_PER_LIFE`] events each under the claim's token, the last with the end.
    /// Err if the claim did not take every run, or a step did not write every run's event.
    pub async fn floor_life(
        &self,
        statement: &FloorStatement,
        runs: &[uuid::Uuid],
        life: i64,
        projection: &serde_json::Value,
    ) -> Result<(), StoreError> {
        let Some([claim, setup, end]) = &statement.life else {
            return Err(StoreError::Invalid(format!(
                "{:?} is a step's shape, not a run's life",
                statement.shape
            )));
        };
        let (Some(first), Ok(limit)) = (runs.first(), i64::try_from(runs.len())) else {
            return Ok(());
        };
        let queue = format!("floor-{first}");
        if life == 1 {
            sqlx::query(sqlx::AssertSqlSafe(setup.as_str()))
                .bind(runs)
                .bind(&queue)
                .execute(self.pool())
                .await?;
        }
        // Created with token 1, each life's claim grants the next.
        let token = life + 1;
        type Claimed = (
            uuid::Uuid,
            i64,
            String,
            i64,
            sqlx::types::Json<serde_json::Value>,
        );
        let claimed: Vec<Claimed> = sqlx::query_as(sqlx::AssertSqlSafe(claim.as_str()))
            .bind(&queue)
            .bind(limit)
            .fetch_all(self.pool())
            .await?;
        if claimed.len() != runs.len() || claimed.iter().any(|c| c.1 != token) {
            return Err(StoreError::Corrupt(format!(
                "the floor's life {life} claimed {} of {} runs (tokens {:?}, {token} expected)",
                claimed.len(),
                runs.len(),
                claimed.iter().map(|c| c.1).collect::<Vec<_>>()
            )));
        }
        let projections = vec![sqlx::types::Json(projection); runs.len()];
        let what = format!("life {life}");
        for step in 1..=FLOOR_EVENTS_PER_LIFE {
            let sequence = (life - 1) * FLOOR_EVENTS_PER_LIFE + step;
            // The last step ends the run: its event with the row's update.
            let (sql, projections) = if step == FLOOR_EVENTS_PER_LIFE {
                (end.as_str(), Some(projections.as_slice()))
            } else {
                (statement.sql.as_str(), None)
            };
            self.floor_write(sql, runs, sequence, (Some(token), projections), &what)
                .await?;
        }
        Ok(())
    }

    /// Drops the floor's scratch tables.
    pub async fn floor_drop(&self, prefix: &str) -> Result<(), StoreError> {
        let p = scratch_ident(prefix)?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS {p}_runs, {p}_events"
        )))
        .execute(self.pool())
        .await?;
        Ok(())
    }
}

/// The bare writes a step's commit cannot do without, measured by `rein bench --floor` on
/// scratch copies of the tables, one statement for many runs as Rein's commit does: where
/// the floor under Rein's cost per event lies, next to the reference's insert.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FloorShape {
    /// Each run's event inserted, under both keys of the log.
    EventsOnly,
    /// And each run's row locked in run_id order and updated under its token, lease and
    /// sequence (state, last sequence): the fencing check a commit makes.
    RunRow,
    /// And the run's projection written with it, as Rein's commit writes it every step.
    Projection,
    /// Each run's event only, under its token: the run's row is share-locked and its token,
    /// lease and owner checked, but not updated, and a sequence already in the log writes
    /// nothing. The least a step can write and stay fenced (SPEC X3) if its projection were
    /// folded from the log instead of written to the row: a claim's row lock cannot pass the
    /// share lock, so no stale holder's event lands after a new token is granted.
    FencedEvent,
    /// A run's whole life in that layout, [`FLOOR_EVENTS_PER_LIFE`] events as a chain4 run
    /// has: its claim (taken from the claim index, token bumped, lease set, projection read
    /// back), its events but the last as in `FencedEvent` under the new token, and the last
    /// with the run's one row update (sequence, projection, lease released). Measured by
    /// [`Store::floor_life`], a life per call; not one of [`FloorShape::ALL`]'s steps.
    FencedRun,
}

/// The events of one life of [`FloorShape::FencedRun`]: a chain4 run's steps.
pub const FLOOR_EVENTS_PER_LIFE: i64 = 4;

/// A floor shape's statement on the scratch tables of one prefix, made once per shape
/// ([`FloorShape::statement`]) so a step only binds and sends it.
#[derive(Debug, Clone)]
pub struct FloorStatement {
    shape: FloorShape,
    sql: String,
    /// [`FloorShape::FencedRun`]'s claim, its setup and its last step (`sql` is its other
    /// steps').
    life: Option<[String; 3]>,
}

impl FloorShape {
    pub const ALL: [FloorShape; 4] = [
        Self::EventsOnly,
        Self::RunRow,
        Self::Projection,
        Self::FencedEvent,
    ];

    /// This shape's statement on the scratch tables `{prefix}_runs` and `{prefix}_events`.
    pub fn statement(self, prefix: &str) -> Result<FloorStatement, StoreError> {
        let p = scratch_ident(prefix)?;
        // A life's last step: its event with the run's one row update, which writes the
        // projection and releases the lease (the run is claimable again).
        let life = (self == Self::FencedRun).then(|| {
            let end = run_row_text(
                "a run's life, its last event and its end",
                Some("$6"),
                "last_sequence = $2, projection = q.projection, lease_owner = NULL, \
                 lease_until = NULL, ready_at = clock_timestamp()",
                "r.fencing_token = $5",
            );
            [
                FLOOR_LIFE_CLAIM.to_owned(),
                FLOOR_LIFE_SETUP.to_owned(),
                end,
            ]
            .map(|t| t.replace("{p}", p))
        });
        Ok(FloorStatement {
            shape: self,
            sql: self.text().replace("{p}", p),
            life,
        })
    }

    fn text(self) -> String {
        match self {
            Self::EventsOnly => FLOOR_EVENTS_ONLY.to_owned(),
            Self::RunRow => run_row_text(
                "events and the run row",
                None,
                "state = 'step', last_sequence = $2",
                STEP_CHECK,
            ),
            Self::Projection => run_row_text(
                "events and the run row and its projection",
                Some("$5"),
                "state = 'step', last_sequence = $2, projection = q.projection",
                STEP_CHECK,
            ),
            Self::FencedEvent => FLOOR_FENCED_EVENT
                .replace("{title}", "events under a share-locked token")
                .replace("{token}", "1"),
            Self::FencedRun => FLOOR_FENCED_EVENT
                .replace("{title}", "a run's life, an event under its token")
                .replace("{token}", "$5"),
        }
    }
}

const FLOOR_EVENTS_ONLY: &str = "-- rein bench floor: events only
WITH ins AS (
    INSERT INTO {p}_events (run_id, sequence, event_id, type, payload, node, fencing_token, worker)
    SELECT u.run_id, $2, u.event_id, 'next', u.payload, 'step', 1, 'floor'
    FROM unnest($1::uuid[], $3::uuid[], $4::jsonb[]) AS u(run_id, event_id, payload)
    RETURNING 1
)
SELECT count(*) FROM ins";

/// The fenced event, `{token}` its holder's: 1 for [`FloorShape::FencedEvent`] (the runs'
/// token at their creation), `$5` for [`FloorShape::FencedRun`]'s steps (what the life's
/// claim granted; its last step also binds `$6`, the projections).
const FLOOR_FENCED_EVENT: &str = "-- rein bench floor: {title}
WITH held AS (
    SELECT u.run_id, u.event_id, u.payload, r.fencing_token
    FROM unnest($1::uuid[], $3::uuid[], $4::jsonb[]) AS u(run_id, event_id, payload)
    JOIN {p}_runs r ON r.run_id = u.run_id
    WHERE r.fencing_token = {token} AND r.lease_owner = 'floor' AND r.lease_until > clock_timestamp()
    ORDER BY r.run_id
    FOR SHARE OF r
),
ins AS (
    INSERT INTO {p}_events (run_id, sequence, event_id, type, payload, node, fencing_token, worker)
    SELECT run_id, $2, event_id, 'next', payload, 'step', fencing_token, 'floor' FROM held
    ON CONFLICT DO NOTHING
    RETURNING 1
)
SELECT count(*) FROM ins";

/// The claim of a life: the queue's runnable, unleased runs by the claim index, as Rein's
/// claim takes them. `$1` the queue, `$2` how many.
const FLOOR_LIFE_CLAIM: &str = "-- rein bench floor: a run's life, its claim
WITH picked AS (
    SELECT run_id FROM {p}_runs
    WHERE queue = $1 AND status = 'runnable' AND lease_owner IS NULL
    ORDER BY priority DESC, ready_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE {p}_runs r SET fencing_token = r.fencing_token + 1, lease_owner = 'floor',
                      lease_until = clock_timestamp() + interval '1 day',
                      updated_at = clock_timestamp()
FROM picked WHERE r.run_id = picked.run_id
RETURNING r.run_id, r.fencing_token, r.state, r.last_sequence, r.projection";

/// Before a connection's first life: its runs in a queue of their own, unleased. `$1` the
/// runs, `$2` the queue.
const FLOOR_LIFE_SETUP: &str = "-- rein bench floor: a run's life, its queue
UPDATE {p}_runs SET queue = $2, lease_owner = NULL, lease_until = NULL WHERE run_id = ANY($1)";

/// The shapes that update the run's row with its event, under `check`, with `set` (and, when
/// `projections` names a parameter, the projections it binds): [`FloorShape::RunRow`],
/// [`FloorShape::Projection`], and the last step of a [`FloorShape::FencedRun`] life.
fn run_row_text(title: &str, projections: Option<&str>, set: &str, check: &str) -> String {
    let (array, column) = match projections {
        Some(param) => (format!(", {param}::jsonb[]"), ", projection"),
        None => (String::new(), ""),
    };
    format!(
        "-- rein bench floor: {title}
WITH req AS (
    SELECT * FROM unnest($1::uuid[], $3::uuid[], $4::jsonb[]{array})
        AS u(run_id, event_id, payload{column})
),
locked AS (
    SELECT q.* FROM req q JOIN {{p}}_runs r ON r.run_id = q.run_id ORDER BY r.run_id FOR UPDATE OF r
),
upd AS (
    UPDATE {{p}}_runs r SET {set}, updated_at = clock_timestamp()
    FROM locked q
    WHERE r.run_id = q.run_id AND {check}
      AND r.lease_owner = 'floor' AND r.lease_until > clock_timestamp()
    RETURNING r.run_id, r.fencing_token, q.event_id, q.payload
),
ins AS (
    INSERT INTO {{p}}_events (run_id, sequence, event_id, type, payload, node, fencing_token, worker)
    SELECT run_id, $2, event_id, 'next', payload, 'step', fencing_token, 'floor' FROM upd
    RETURNING 1
)
SELECT count(*) FROM ins"
    )
}

/// The check of a step's shape: the runs' token at their creation and the step's sequence.
const STEP_CHECK: &str = "r.fencing_token = 1 AND r.last_sequence = $2 - 1";

/// What [`Store::copy_runs`] writes.
#[derive(Debug, Clone)]
pub struct RunCopies<'a> {
    pub template: uuid::Uuid,
    pub queue: &'a str,
    /// Makes the copies' run ids differ from another fill's.
    pub salt: &'a str,
    pub first: i64,
    pub last: i64,
    /// Copy i is created at `created_from + i * created_every_ms`.
    pub created_from: chrono::DateTime<chrono::Utc>,
    pub created_every_ms: f64,
    /// Every copy whose number is a multiple of this has its timer due now (0: none).
    pub due_every: i64,
}

/// What one kind of statement is: the commit, the claim, the lease renewal, the reference's
/// scratch insert, or anything else the database ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StatementKind {
    Commit,
    Claim,
    Renew,
    Reference,
    /// A statement of `rein bench --floor` ([`FloorShape`]).
    Floor,
    Other,
}

/// One statement's counters in `pg_stat_statements` (cumulative, or the difference of two
/// snapshots).
#[derive(Debug, Clone, Serialize)]
pub struct StatementCost {
    pub queryid: i64,
    pub kind: StatementKind,
    /// The statement's first line (its leading comment for Rein's own queries).
    pub text: String,
    pub calls: i64,
    /// Rows returned or changed: the runs taken, for the claim.
    pub rows: i64,
    /// Time spent executing, in milliseconds (planning not included; Rein's statements use
    /// generic plans).
    pub total_ms: f64,
    pub wal_bytes: i64,
}

/// The database's cost counters at one moment: the server's WAL position and, when
/// `pg_stat_statements` is loaded, every statement of this database.
#[derive(Debug, Clone)]
pub struct DbCost {
    /// Bytes of WAL written since the server's start of time (`pg_current_wal_lsn()`).
    /// Server-wide: other databases on the same server write into it too.
    pub wal_lsn: i64,
    /// None when `pg_stat_statements` is not available (see [`Store::statement_stats`]).
    pub statements: Option<Vec<StatementCost>>,
}

impl DbCost {
    /// What happened between `before` and `self`: WAL bytes, and statements that ran.
    pub fn since(&self, before: &DbCost) -> (i64, Option<Vec<StatementCost>>) {
        let wal = self.wal_lsn - before.wal_lsn;
        let statements = match (&self.statements, &before.statements) {
            (Some(after), Some(prior)) => {
                let prior: std::collections::HashMap<i64, &StatementCost> =
                    prior.iter().map(|s| (s.queryid, s)).collect();
                let mut diff: Vec<StatementCost> = after
                    .iter()
                    .filter_map(|s| {
                        let mut d = s.clone();
                        if let Some(p) = prior.get(&s.queryid) {
                            d.calls -= p.calls;
                            d.rows -= p.rows;
                            d.total_ms -= p.total_ms;
                            d.wal_bytes -= p.wal_bytes;
                        }
                        (d.calls > 0).then_some(d)
                    })
                    .collect();
                diff.sort_by(|a, b| b.total_ms.total_cmp(&a.total_ms));
                Some(diff)
            }
            _ => None,
        };
        (wal, statements)
    }
}

/// How much of a statement's text tells statements apart: Rein's own queries open with a
/// comment of their own, and pg_stat_statements replaces constants further on.
const TEXT_PREFIX_CHARS: usize = 120;

fn prefix(sql: &str) -> String {
    sql.trim().chars().take(TEXT_PREFIX_CHARS).collect()
}

fn statement_kind(text: &str) -> StatementKind {
    let known = [
        (include_str!("../queries/commit.sql"), StatementKind::Commit),
        (include_str!("../queries/claim.sql"), StatementKind::Claim),
        (include_str!("../queries/renew.sql"), StatementKind::Renew),
    ];
    // Contained rather than equal: a statement first seen as `PREPARE name AS ...` (the
    // same query id) keeps that text.
    if let Some((_, kind)) = known.iter().find(|(sql, _)| text.contains(&prefix(sql))) {
        return *kind;
    }
    if text.trim().starts_with("INSERT INTO rein_bench_scratch_") {
        return StatementKind::Reference;
    }
    if text.trim().starts_with("-- rein bench floor") {
        return StatementKind::Floor;
    }
    StatementKind::Other
}

impl Store {
    /// Whether this database's statements can be measured: `pg_stat_statements` must be
    /// loaded by the server (shared_preload_libraries) and created in the database. With
    /// `create`, the extension is created when missing (the benchmark's private server);
    /// otherwise a database without it is left as it is. Err says why it is unavailable.
    pub async fn statement_stats(&self, create: bool) -> Result<(), String> {
        let installed: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pg_stat_statements')",
        )
        .fetch_one(self.pool())
        .await
        .map_err(|e| e.to_string())?;
        if !installed {
            if !create {
                return Err("pg_stat_statements is not created in this database \
                            (CREATE EXTENSION pg_stat_statements, with it in the server's \
                            shared_preload_libraries)"
                    .to_owned());
            }
            sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                .execute(self.pool())
                .await
                .map_err(|e| format!("cannot create pg_stat_statements: {e}"))?;
        }
        sqlx::query("SELECT 1 FROM pg_stat_statements LIMIT 1")
            .execute(self.pool())
            .await
            .map_err(|e| match e.as_database_error() {
                Some(d) => format!("pg_stat_statements: {}", d.message()),
                None => e.to_string(),
            })?;
        Ok(())
    }

    /// The cost counters now; statements only when `with_statements` (after
    /// [`Store::statement_stats`] said they are available).
    pub async fn db_cost(&self, with_statements: bool) -> Result<DbCost, StoreError> {
        let wal_lsn: i64 =
            sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
                .fetch_one(self.pool())
                .await?;
        if !with_statements {
            return Ok(DbCost {
                wal_lsn,
                statements: None,
            });
        }
        let rows: Vec<(i64, String, i64, i64, f64, i64)> = sqlx::query_as(
            "SELECT queryid, left(query, $1), calls, rows, total_exec_time,
                    wal_bytes::bigint
             FROM pg_stat_statements
             WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND queryid IS NOT NULL",
        )
        .bind(i32::try_from(TEXT_PREFIX_CHARS * 2).unwrap_or(i32::MAX))
        .fetch_all(self.pool())
        .await?;
        // One entry per (user, query): the same statement run by another role is added up.
        let mut by_id: std::collections::BTreeMap<i64, StatementCost> = Default::default();
        for (queryid, query, calls, rows, total_ms, wal_bytes) in rows {
            let e = by_id.entry(queryid).or_insert_with(|| StatementCost {
                queryid,
                kind: statement_kind(&query),
                text: query
                    .trim()
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .chars()
                    .take(100)
                    .collect(),
                calls: 0,
                rows: 0,
                total_ms: 0.0,
                wal_bytes: 0,
            });
            e.calls += calls;
            e.rows += rows;
            e.total_ms += total_ms;
            e.wal_bytes += wal_bytes;
        }
        Ok(DbCost {
            wal_lsn,
            statements: Some(by_id.into_values().collect()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_are_told_apart_by_their_text() {
        assert_eq!(
            statement_kind(include_str!("../queries/commit.sql")),
            StatementKind::Commit
        );
        assert_eq!(
            statement_kind(&format!(
                "PREPARE c AS {}  ",
                include_str!("../queries/claim.sql")
            )),
            StatementKind::Claim
        );
        assert_eq!(
            statement_kind("INSERT INTO rein_bench_scratch_12 (run_id, payload) VALUES ($1, $2)"),
            StatementKind::Reference
        );
        assert_eq!(statement_kind("SELECT 1"), StatementKind::Other);
    }
}
