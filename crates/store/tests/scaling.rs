//! What docs/SCALING.md promises about running Rein distributed by `run_id`, checked against
//! the schema the migrations build and the SQL the store sends: every table is keyed by
//! `run_id` first or is listed there with its placement and why; every statement that reads
//! or writes a per-run table filters on `run_id`, or is listed there as fleet-wide.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn scaling_doc() -> String {
    std::fs::read_to_string(repo().join("docs/SCALING.md")).expect("docs/SCALING.md")
}

/// The rows of the markdown table under `heading`: the cells of each row, backticks removed.
fn table_under(doc: &str, heading: &str) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    let mut inside = false;
    for line in doc.lines() {
        if line.starts_with('#') {
            inside = line.trim_start_matches('#').trim() == heading;
            continue;
        }
        let line = line.trim();
        if !inside || !line.starts_with('|') || line.starts_with("|--") || line.starts_with("| --")
        {
            continue;
        }
        let cells: Vec<String> = line
            .trim_matches('|')
            .split('|')
            .map(|c| c.trim().replace('`', ""))
            .collect();
        rows.push(cells);
    }
    // The first row is the header.
    if !rows.is_empty() {
        rows.remove(0);
    }
    rows
}

/// Placements a table may have on a distributed database.
const PLACEMENTS: [&str; 4] = [
    "distributed",
    "reference",
    "distributed by its own key",
    "local",
];

/// `table → (placement, why)` from SCALING.md's "Tables" section.
fn documented_tables(doc: &str) -> BTreeMap<String, (String, String)> {
    let rows = table_under(doc, "Tables");
    assert!(
        !rows.is_empty(),
        "SCALING.md has no table under `## Tables`"
    );
    rows.into_iter()
        .map(|cells| {
            assert!(
                cells.len() >= 3,
                "a row of SCALING.md's table list has fewer than 3 cells: {cells:?}"
            );
            assert!(
                PLACEMENTS.contains(&cells[1].as_str()),
                "SCALING.md places {} as `{}`; say one of {PLACEMENTS:?}",
                cells[0],
                cells[1]
            );
            (cells[0].clone(), (cells[1].clone(), cells[2].clone()))
        })
        .collect()
}

#[tokio::test]
async fn every_table_is_keyed_by_run_id_first_or_says_why_not() {
    let store = common::store("scaling_keys").await;
    let keys: Vec<(String, Vec<String>)> = sqlx::query_as(
        "SELECT c.relname::text,
                COALESCE(array_agg(a.attname::text ORDER BY array_position(i.indkey::int2[], a.attnum))
                         FILTER (WHERE a.attnum IS NOT NULL), '{}')
         FROM pg_class c
         JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = current_schema()
         LEFT JOIN pg_index i ON i.indrelid = c.oid AND i.indisprimary
         LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = ANY (i.indkey)
         WHERE c.relkind IN ('r', 'p') AND c.relname LIKE 'rein\\_%'
         GROUP BY c.relname ORDER BY c.relname",
    )
    .fetch_all(store.pool())
    .await
    .unwrap();
    assert!(keys.len() > 10, "the schema has tables: {keys:?}");
    let documented = documented_tables(&scaling_doc());
    let mut problems = Vec::new();
    for (table, key) in &keys {
        let first = key.first().map(String::as_str);
        match (documented.get(table), first) {
            (None, Some("run_id")) => {}
            (None, _) => problems.push(format!(
                "{table} has primary key {key:?}, which does not start with run_id: key it by \
                 run_id first, or list it under `## Tables` in docs/SCALING.md with its \
                 placement and why"
            )),
            (Some((placement, _)), Some("run_id")) if placement != "distributed" => {
                problems.push(format!(
                    "{table} is keyed by run_id first but SCALING.md places it as `{placement}`"
                ))
            }
            (Some((placement, why)), _) if why.len() < 20 => problems.push(format!(
                "SCALING.md places {table} as `{placement}` without saying why"
            )),
            (Some(_), _) => {}
        }
    }
    let existing: BTreeSet<&str> = keys.iter().map(|(t, _)| t.as_str()).collect();
    for table in documented.keys() {
        if !existing.contains(table.as_str()) {
            problems.push(format!(
                "SCALING.md lists {table}, which the migrations do not create"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// String literals of a Rust source (plain and raw), with escapes left as written.
fn string_literals(source: &str) -> Vec<String> {
    let bytes = source.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'/' if bytes.get(i + 1) == Some(&b'/') => {
                while i < bytes.len() && bytes[i] != b'\n' {
                    i += 1;
                }
            }
            b'\'' => {
                // A char literal ('"' among them) or a lifetime: skip what a char literal spans.
                if bytes.get(i + 2) == Some(&b'\'') {
                    i += 3;
                } else if bytes.get(i + 1) == Some(&b'\\') {
                    i += 4;
                } else {
                    i += 1;
                }
            }
            b'r' if matches!(bytes.get(i + 1), Some(b'#') | Some(b'"'))
                && (i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_')) =>
            {
                let mut hashes = 0;
                let mut j = i + 1;
                while bytes.get(j) == Some(&b'#') {
                    hashes += 1;
                    j += 1;
                }
                if bytes.get(j) != Some(&b'"') {
                    i += 1;
                    continue;
                }
                let close = format!("\"{}", "#".repeat(hashes));
                let start = j + 1;
                let end = source[start..]
                    .find(&close)
                    .map_or(bytes.len(), |e| start + e);
                out.push(source[start..end].to_owned());
                i = end + close.len();
            }
            b'"' => {
                let start = i + 1;
                let mut j = start;
                while j < bytes.len() && bytes[j] != b'"' {
                    if bytes[j] == b'\\' {
                        j += 1;
                    }
                    j += 1;
                }
                out.push(source[start..j.min(bytes.len())].to_owned());
                i = j + 1;
            }
            _ => i += 1,
        }
    }
    out
}

/// The SQL statements the store sends: every query file, and every string literal of its
/// sources that begins like a statement.
fn store_statements() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(root.join("queries"))
        .unwrap()
        .chain(std::fs::read_dir(root.join("src")).unwrap())
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for path in files {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let text = std::fs::read_to_string(&path).unwrap();
        if name.ends_with(".sql") {
            out.push((name, text));
            continue;
        }
        // Tests in a source file are not statements the store sends.
        let text = text.split("#[cfg(test)]").next().unwrap_or_default();
        for literal in string_literals(text) {
            let head = literal.trim_start().to_ascii_uppercase();
            if ["SELECT ", "INSERT ", "UPDATE ", "DELETE ", "WITH "]
                .iter()
                .any(|k| head.starts_with(k))
            {
                out.push((name.clone(), literal));
            }
        }
    }
    out
}

/// The tables `sql` reads or writes (`FROM`, `JOIN`, `INTO`, `UPDATE`, `USING` followed by a
/// `rein_` name).
fn tables_of(sql: &str) -> BTreeSet<String> {
    let words: Vec<&str> = sql
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .collect();
    words
        .windows(2)
        .filter(|w| {
            ["FROM", "JOIN", "INTO", "UPDATE", "USING"]
                .iter()
                .any(|k| w[0].eq_ignore_ascii_case(k))
                && w[1].starts_with("rein_")
        })
        .map(|w| w[1].to_owned())
        .collect()
}

/// Whether `sql` goes by some `run_id`: compares it (`run_id =`, `run_id IN`,
/// `run_id = ANY`, `USING (run_id, …)`), or inserts rows that carry it (an insert is routed
/// by the values it writes).
fn filters_on_run_id(sql: &str) -> bool {
    let flat: String = sql.split_whitespace().collect::<Vec<_>>().join(" ");
    let lower = flat.to_ascii_lowercase();
    let compared = lower.match_indices("run_id").any(|(at, _)| {
        let after = lower[at + "run_id".len()..].trim_start();
        after.starts_with('=') || after.starts_with("in ") || after.starts_with("in(")
    });
    let inserted = lower.trim_start().starts_with("insert into")
        && lower
            .split_once('(')
            .and_then(|(_, rest)| rest.split_once(')'))
            .is_some_and(|(columns, _)| columns.split(',').any(|c| c.trim() == "run_id"));
    compared || inserted || lower.contains("using (run_id")
}

/// The first line of a statement that is not a comment, as SCALING.md quotes it.
fn first_line(sql: &str) -> String {
    sql.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with("--"))
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn every_statement_on_a_per_run_table_filters_on_run_id_or_is_listed_as_fleet_wide() {
    let doc = scaling_doc();
    let distributed: BTreeSet<String> = documented_tables(&doc)
        .into_iter()
        .filter(|(_, (placement, _))| placement == "distributed")
        .map(|(t, _)| t)
        .chain(["rein_runs", "rein_events"].map(str::to_owned))
        .collect();
    let fleet_wide: Vec<(String, String)> = table_under(&doc, "Fleet-wide statements")
        .into_iter()
        .map(|cells| (cells[0].clone(), cells[1].clone()))
        .collect();

    assert!(
        !fleet_wide.is_empty(),
        "SCALING.md has no table under `## Fleet-wide statements`"
    );
    let statements = store_statements();
    assert!(
        statements.len() > 50,
        "found {} statements",
        statements.len()
    );
    let mut used = BTreeSet::new();
    let mut problems = Vec::new();
    for (file, sql) in &statements {
        let touches: Vec<String> = tables_of(sql)
            .into_iter()
            .filter(|t| distributed.contains(t))
            .collect();
        if touches.is_empty() || filters_on_run_id(sql) {
            continue;
        }
        let line = first_line(sql);
        // The longest listed beginning that fits: one may begin another.
        match fleet_wide
            .iter()
            .enumerate()
            .filter(|(_, (f, begins))| f == file && line.starts_with(begins.as_str()))
            .max_by_key(|(_, (_, begins))| begins.len())
            .map(|(i, _)| i)
        {
            Some(i) => {
                used.insert(i);
            }
            None => problems.push(format!(
                "{file}: a statement on {touches:?} does not filter on run_id: `{line}`; filter \
                 it by run_id, or list it under `## Fleet-wide statements` in docs/SCALING.md \
                 as | {file} | {} | what it becomes on a distributed database |",
                line.chars().take(60).collect::<String>()
            )),
        }
    }
    for (i, (file, begins)) in fleet_wide.iter().enumerate() {
        if !used.contains(&i) {
            problems.push(format!(
                "SCALING.md lists a fleet-wide statement of {file} beginning `{begins}` that the \
                 store no longer sends (or that now filters on run_id): take it off the list"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_checker_catches_a_statement_that_scans_a_per_run_table() {
    let scan = "SELECT count(*) FROM rein_events WHERE type = $1";
    assert_eq!(tables_of(scan), BTreeSet::from(["rein_events".to_owned()]));
    assert!(!filters_on_run_id(scan));
    assert!(!filters_on_run_id(
        "SELECT run_id FROM rein_runs WHERE status = $1"
    ));
    assert!(filters_on_run_id(
        "SELECT * FROM rein_events WHERE run_id = $1"
    ));
    assert!(filters_on_run_id(
        "DELETE FROM rein_inbox WHERE run_id IN (SELECT run_id FROM x)"
    ));
    assert!(filters_on_run_id(
        "INSERT INTO rein_approvals (approval_id, run_id) VALUES ($1, $2)"
    ));
    assert!(!filters_on_run_id(
        "INSERT INTO rein_counters (name, value) SELECT run_id, 1 FROM rein_runs"
    ));
    assert!(filters_on_run_id(
        "SELECT 1 FROM unnest($1) AS w(run_id, sequence) JOIN rein_events e USING (run_id, sequence)"
    ));
    let literals =
        string_literals("let a = '\"'; sqlx::query(r#\"SELECT 1 FROM rein_runs\"#); \"x\\\"y\"");
    assert_eq!(literals, vec!["SELECT 1 FROM rein_runs", "x\\\"y"]);
    let doc = "## Tables\n| table | placement | why |\n|---|---|---|\n| `rein_x` | reference | small and read everywhere |\n## Other\n| a | b |\n|--|--|\n| c | d |\n";
    let tables = documented_tables(doc);
    assert_eq!(tables.len(), 1);
    assert_eq!(tables["rein_x"].0, "reference");
}

/// The migration that partitions the log, on a database that already holds one: the old
/// rows stay where they are (no copy of the log), a hashed id above the cut goes to the
/// default partition, every event still reads through the view, new events land in their
/// month, and the log is still append-only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_from_before_partitions_stays_in_place_and_every_event_still_reads() {
    const PARTITIONS: i64 = 20261208000100;
    let url = rein_devdb::test_database("scaling_before", env!("CARGO_TARGET_TMPDIR"))
        .expect("a test database");
    let store = rein_store::Store::connect_without_migrating(&url, 2)
        .await
        .expect("connect");
    // As `rein migrate` applies them, up to the partitions and then the rest.
    let apply = |before: bool| {
        let store = store.clone();
        async move {
            use sqlx::migrate::Migrate;
            let mut conn = store.pool().acquire().await.expect("connection");
            conn.ensure_migrations_table("_sqlx_migrations")
                .await
                .expect("migrations table");
            for m in rein_store::MIGRATOR
                .iter()
                .filter(|m| (m.version < PARTITIONS) == before)
            {
                conn.apply("_sqlx_migrations", m)
                    .await
                    .unwrap_or_else(|e| panic!("migration {}: {e}", m.version));
            }
        }
    };
    apply(true).await;
    // 90 runs created over the past days (UUIDv7 from their time), 10 with hashed ids all
    // over the range (branch children of earlier releases), 5 archived events.
    sqlx::raw_sql(
        "INSERT INTO rein_events (run_id, sequence, event_id, type, fencing_token, worker)
         SELECT (CASE WHEN i % 10 = 0 THEN 'f' || substr(md5(i::text), 2, 31)
                      ELSE lpad(to_hex((extract(epoch FROM now() - i * interval '1 hour') * 1000)::bigint), 12, '0')
                           || '7' || substr(md5(i::text), 1, 3) || '8' || substr(md5(i::text), 4, 15)
                 END)::uuid, 1, gen_random_uuid(), 'CREATED', 1, 'w'
         FROM generate_series(1, 100) AS i;
         INSERT INTO rein_events_archive (run_id, sequence, event_id, type, payload, schema_version,
                                          fencing_token, worker, occurred_at)
         SELECT ('0' || substr(md5(i::text), 2, 31))::uuid, 1, gen_random_uuid(), 'CREATED', '{}', 1, 1, 'w', now()
         FROM generate_series(1, 5) AS i;",
    )
    .execute(store.pool())
    .await
    .expect("a log from before");
    let heap_before: i64 = sqlx::query_scalar("SELECT pg_relation_filenode('rein_events')::bigint")
        .fetch_one(store.pool())
        .await
        .expect("filenode");
    apply(false).await;

    let placed: Vec<(String, i64)> = sqlx::query_as(
        "SELECT tableoid::regclass::text, count(*) FROM rein_events GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(store.pool())
    .await
    .expect("placed");
    assert_eq!(
        placed,
        vec![
            ("rein_events_before".to_owned(), 90),
            ("rein_events_other".to_owned(), 10)
        ]
    );
    let kept: i64 = sqlx::query_scalar("SELECT pg_relation_filenode('rein_events_before')::bigint")
        .fetch_one(store.pool())
        .await
        .expect("filenode");
    assert_eq!(
        kept, heap_before,
        "the old log is the same table, not a copy"
    );
    let all: i64 = sqlx::query_scalar("SELECT count(*) FROM rein_events_all")
        .fetch_one(store.pool())
        .await
        .expect("all");
    assert_eq!(all, 105, "every event reads through the view");

    // A run made now lands in this month's partition; the log refuses an update.
    let now_id = uuid::Uuid::now_v7();
    sqlx::query(
        "INSERT INTO rein_events (run_id, sequence, event_id, type, fencing_token, worker)
         VALUES ($1, 1, gen_random_uuid(), 'CREATED', 1, 'w')",
    )
    .bind(now_id)
    .execute(store.pool())
    .await
    .expect("a new event");
    let (home, month): (String, String) = sqlx::query_as(
        "SELECT tableoid::regclass::text,
                'rein_events_' || to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYYMM')
         FROM rein_events WHERE run_id = $1",
    )
    .bind(now_id)
    .fetch_one(store.pool())
    .await
    .expect("home");
    assert_eq!(home, month);
    let refused = sqlx::query("UPDATE rein_events SET type = 'X' WHERE run_id = $1")
        .bind(now_id)
        .execute(store.pool())
        .await;
    assert!(
        refused.is_err_and(|e| e.to_string().contains("append-only")),
        "the log stays append-only"
    );
    let triggers: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_trigger
         WHERE tgrelid = 'rein_events_before'::regclass AND NOT tgisinternal
           AND tgparentid = 0",
    )
    .fetch_one(store.pool())
    .await
    .expect("triggers");
    assert_eq!(
        triggers, 0,
        "the old table keeps no trigger of its own: each fires once"
    );
}
