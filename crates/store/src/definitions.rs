//! Definition versions: publishing them (who did, and whether the new version becomes the
//! name's current one, SPEC Z4), the current-version pointer that runs enqueued without a
//! version follow, and loading them back compiled, from a bounded cache that the stored
//! row's hash keeps honest.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use chrono::{DateTime, Utc};
use rein_core::Definition;
use serde::Serialize;
use sqlx::Row;

use crate::{Store, StoreError};

/// Who publishes the built-in definitions a binary ships (`rein migrate`, a role starting
/// against a database that lacks one).
pub const BUILTIN_PUBLISHER: &str = "rein";
/// Who publishes a definition registered by code holding the database itself.
pub const OPERATOR: &str = "operator";
/// Most compiled definitions one process keeps.
pub const DEFINITION_CACHE_ENTRIES_MAX: usize = 256;
/// Most bytes of stored definition text the compiled definitions one process keeps stand
/// for; a definition larger than this alone is compiled on every load.
pub const DEFINITION_CACHE_BYTES_MAX: usize = 32 * 1024 * 1024;

/// Who publishes a version, and whether it becomes its name's current version at once.
#[derive(Debug, Clone, Copy)]
pub struct Publication<'a> {
    /// An API token's subject, the CLI's `--as` name, [`BUILTIN_PUBLISHER`].
    pub by: &'a str,
    /// Point the name at this version. The first version of a new name is current anyway.
    pub make_current: bool,
}

/// What publishing did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    /// False when this exact body was already registered under this version.
    pub created: bool,
    /// The name's current version once the call is done.
    pub current_version: u32,
}

/// A registered definition version, without its body.
#[derive(Debug, Clone, Serialize)]
pub struct DefinitionRow {
    pub name: String,
    pub version: u32,
    pub hash: String,
    pub description: String,
    pub created_at: DateTime<Utc>,
    /// Who registered it; absent for versions registered before Rein recorded it.
    pub registered_by: Option<String>,
    /// Whether runs enqueued without a version start with this one.
    pub current: bool,
}

/// Where a name's current-version pointer was and is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CurrentMoved {
    pub previous: Option<u32>,
    pub version: u32,
}

impl Store {
    /// Stores a definition version registered by [`OPERATOR`], the first of its name made
    /// current. Registering the same body again is a no-op; a different body under an
    /// existing version is refused (V1: change means a new version).
    pub async fn register_definition(&self, def: &Definition) -> Result<bool, StoreError> {
        let published = self
            .publish_definition(
                def,
                Publication {
                    by: OPERATOR,
                    make_current: false,
                },
            )
            .await?;
        Ok(published.created)
    }

    /// Stores a definition version as published by `publication.by`. The same body again
    /// stores nothing (the pointer still moves when asked); another body under a stored
    /// version is [`StoreError::DefinitionConflict`]. A new name's first version becomes
    /// its current one; later versions do only with `make_current`.
    pub async fn publish_definition(
        &self,
        def: &Definition,
        publication: Publication<'_>,
    ) -> Result<Published, StoreError> {
        check_publisher(publication.by)?;
        let body =
            serde_json::to_value(def.spec()).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        crate::input::check_json("definition", &body)?;
        let mut tx = self.pool().begin().await?;
        let inserted = sqlx::query(
            "INSERT INTO rein_definitions (name, version, hash, body, registered_by)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (name, version) DO NOTHING",
        )
        .bind(def.name())
        .bind(def.version() as i32)
        .bind(def.hash())
        .bind(&body)
        .bind(publication.by)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        if !inserted {
            let hash: String = sqlx::query_scalar(
                "SELECT hash FROM rein_definitions WHERE name = $1 AND version = $2",
            )
            .bind(def.name())
            .bind(def.version() as i32)
            .fetch_one(&mut *tx)
            .await?;
            if hash != def.hash() {
                return Err(StoreError::DefinitionConflict {
                    name: def.name().to_owned(),
                    version: def.version(),
                });
            }
        }
        let moved: Option<i32> = sqlx::query_scalar(
            "INSERT INTO rein_definition_current (name, version, moved_by) VALUES ($1, $2, $3)
             ON CONFLICT (name) DO UPDATE
                 SET version = EXCLUDED.version, moved_by = EXCLUDED.moved_by,
                     moved_at = clock_timestamp()
                 WHERE $4::boolean AND rein_definition_current.version <> EXCLUDED.version
             RETURNING version",
        )
        .bind(def.name())
        .bind(def.version() as i32)
        .bind(publication.by)
        .bind(publication.make_current)
        .fetch_optional(&mut *tx)
        .await?;
        // Not moved: the pointer stays where it was (a new statement sees a pointer another
        // registration of a new name committed meanwhile).
        let current = match moved {
            Some(v) => v,
            None => {
                sqlx::query_scalar("SELECT version FROM rein_definition_current WHERE name = $1")
                    .bind(def.name())
                    .fetch_one(&mut *tx)
                    .await?
            }
        };
        tx.commit().await?;
        self.definitions.put(def, body.to_string().len());
        Ok(Published {
            created: inserted,
            current_version: current as u32,
        })
    }

    /// Registers a built-in this binary ships as [`BUILTIN_PUBLISHER`] and points its name
    /// at it, unless a person moved the pointer (a deployment pinned another version); a
    /// pointer the migration set, or an older binary's built-in held, follows the binary.
    pub(crate) async fn publish_builtin(&self, def: &Definition) -> Result<bool, StoreError> {
        let published = self
            .publish_definition(
                def,
                Publication {
                    by: BUILTIN_PUBLISHER,
                    make_current: false,
                },
            )
            .await;
        let created = match published {
            Ok(p) => p.created,
            // An older binary stored this version with a body that lacked a later field:
            // runs of it replay against the body they started with.
            Err(StoreError::DefinitionConflict { name, version }) => {
                tracing::warn!(definition = %name, version,
                    "built-in definition is stored with an older body; keeping it as stored");
                false
            }
            Err(e) => return Err(e),
        };
        sqlx::query(
            "INSERT INTO rein_definition_current (name, version, moved_by) VALUES ($1, $2, $3)
             ON CONFLICT (name) DO UPDATE
                 SET version = EXCLUDED.version, moved_by = EXCLUDED.moved_by,
                     moved_at = clock_timestamp()
                 WHERE (rein_definition_current.moved_by IS NULL
                        OR rein_definition_current.moved_by = EXCLUDED.moved_by)
                   AND rein_definition_current.version <> EXCLUDED.version",
        )
        .bind(def.name())
        .bind(def.version() as i32)
        .bind(BUILTIN_PUBLISHER)
        .execute(self.pool())
        .await?;
        Ok(created)
    }

    /// Points `name` at its registered `version`, as `by`: runs enqueued without a version
    /// start with it from now on. Runs already started keep theirs (SPEC V1).
    pub async fn set_current_definition(
        &self,
        name: &str,
        version: u32,
        by: &str,
    ) -> Result<CurrentMoved, StoreError> {
        check_publisher(by)?;
        let stored = stored_version(name, Some(version))?;
        let moved: Option<(Option<i32>, i32)> = sqlx::query_as(
            "WITH previous AS (SELECT version FROM rein_definition_current WHERE name = $1)
             INSERT INTO rein_definition_current (name, version, moved_by)
             SELECT $1, $2, $3
             WHERE EXISTS (SELECT 1 FROM rein_definitions WHERE name = $1 AND version = $2)
             ON CONFLICT (name) DO UPDATE
                 SET version = EXCLUDED.version, moved_by = EXCLUDED.moved_by,
                     moved_at = clock_timestamp()
             RETURNING (SELECT version FROM previous), version",
        )
        .bind(name)
        .bind(stored)
        .bind(by)
        .fetch_optional(self.pool())
        .await?;
        let Some((previous, version)) = moved else {
            return Err(StoreError::UnknownDefinition {
                name: name.to_owned(),
                version: Some(version),
            });
        };
        tracing::info!(
            definition = name,
            version,
            previous,
            by,
            "current definition version moved"
        );
        Ok(CurrentMoved {
            previous: previous.map(|v| v as u32),
            version: version as u32,
        })
    }

    /// Loads a definition by name, at `version` or the name's current one, compiled once
    /// per process (the row's hash says whether a compiled copy still stands for it).
    pub async fn load_definition(
        &self,
        name: &str,
        version: Option<u32>,
    ) -> Result<Definition, StoreError> {
        load_definition_with(self.pool(), &self.definitions, name, version).await
    }

    /// [`Store::load_definition`] of a run's own `version`, on `conn` (a transaction's).
    pub(crate) async fn load_definition_on(
        &self,
        conn: &mut sqlx::PgConnection,
        name: &str,
        version: u32,
    ) -> Result<Definition, StoreError> {
        load_definition_with(conn, &self.definitions, name, Some(version)).await
    }

    /// One registered version without its body (the current one unless `version`).
    pub async fn definition_row(
        &self,
        name: &str,
        version: Option<u32>,
    ) -> Result<DefinitionRow, StoreError> {
        crate::input::check_text("definition", name)?;
        let stored = stored_version(name, version)?;
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "{ROW_COLUMNS} WHERE d.name = $1
               AND d.version = COALESCE($2, (SELECT version FROM rein_definition_current
                                             WHERE name = $1))"
        )))
        .bind(name)
        .bind(stored)
        .fetch_optional(self.pool())
        .await?;
        match row {
            Some(row) => definition_row(&row),
            None => Err(StoreError::UnknownDefinition {
                name: name.to_owned(),
                version,
            }),
        }
    }

    /// Every registered definition version, by name then version.
    pub async fn list_definitions(&self) -> Result<Vec<DefinitionRow>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "{ROW_COLUMNS} ORDER BY d.name, d.version"
        )))
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(definition_row).collect()
    }

    /// How many definitions this process compiled from stored rows (cache misses).
    pub fn definitions_compiled(&self) -> u64 {
        self.definitions.compiled.load(Ordering::Relaxed)
    }
}

const ROW_COLUMNS: &str = "SELECT d.name, d.version, d.hash,
        coalesce(d.body->>'description', '') AS description, d.created_at, d.registered_by,
        (c.version IS NOT NULL) AS current
    FROM rein_definitions d
    LEFT JOIN rein_definition_current c ON c.name = d.name AND c.version = d.version";

fn definition_row(row: &sqlx::postgres::PgRow) -> Result<DefinitionRow, StoreError> {
    let version: i32 = row.try_get("version")?;
    Ok(DefinitionRow {
        name: row.try_get("name")?,
        version: version as u32,
        hash: row.try_get("hash")?,
        description: row.try_get("description")?,
        created_at: row.try_get("created_at")?,
        registered_by: row.try_get("registered_by")?,
        current: row.try_get("current")?,
    })
}

fn check_publisher(by: &str) -> Result<(), StoreError> {
    if by.trim().is_empty()
        || by.len() > crate::SENDER_BYTES_MAX
        || by.chars().any(char::is_control)
    {
        return Err(StoreError::InvalidField {
            field: "registered_by".into(),
            reason: format!(
                "who publishes a definition must be named in 1..={} bytes without control characters",
                crate::SENDER_BYTES_MAX
            ),
        });
    }
    Ok(())
}

/// `version` as the database stores it, refused outside 1..=VERSION_MAX.
fn stored_version(name: &str, version: Option<u32>) -> Result<Option<i32>, StoreError> {
    crate::input::check_text("definition", name)?;
    match version.map(i32::try_from) {
        None => Ok(None),
        Some(Ok(v)) if v >= 1 => Ok(Some(v)),
        Some(_) => Err(StoreError::Invalid(format!(
            "a definition version is 1..={}",
            rein_core::limits::VERSION_MAX
        ))),
    }
}

/// [`Store::load_definition`] on any executor (a transaction's connection too). One
/// statement resolves the version and returns the body only when no compiled copy this
/// process holds has the row's hash.
pub(crate) async fn load_definition_with<'e>(
    executor: impl sqlx::PgExecutor<'e>,
    cache: &DefinitionCache,
    name: &str,
    version: Option<u32>,
) -> Result<Definition, StoreError> {
    let stored = stored_version(name, version)?;
    // Taken before the statement: an eviction meanwhile cannot lose the copy it names.
    let held = cache.held(name);
    let hashes: Vec<&str> = held.iter().map(|d| d.hash()).collect();
    let row: Option<(i32, String, Option<String>)> = sqlx::query_as(
        "SELECT d.version, d.hash, CASE WHEN d.hash = ANY($3) THEN NULL ELSE d.body::text END
         FROM rein_definitions d
         WHERE d.name = $1
           AND d.version = COALESCE($2, (SELECT version FROM rein_definition_current
                                         WHERE name = $1))",
    )
    .bind(name)
    .bind(stored)
    .bind(&hashes)
    .fetch_optional(executor)
    .await?;
    let Some((found, hash, body)) = row else {
        return Err(StoreError::UnknownDefinition {
            name: name.to_owned(),
            version,
        });
    };
    let Some(body) = body else {
        let def = held
            .into_iter()
            .find(|d| d.hash() == hash && d.version() == found as u32)
            .ok_or_else(|| {
                StoreError::Corrupt(format!(
                    "definition {name} v{found}: hash {hash} matched no compiled copy"
                ))
            })?;
        cache.touch(&def);
        return Ok(def);
    };
    let spec: rein_core::definition::DefinitionSpec = serde_json::from_str(&body)
        .map_err(|e| StoreError::Corrupt(format!("definition {name}: {e}")))?;
    let def =
        Definition::from_stored_spec(spec, &rein_core::GuardRegistry::new()).map_err(|e| {
            StoreError::Corrupt(format!("stored definition {name} no longer validates: {e}"))
        })?;
    cache.compiled.fetch_add(1, Ordering::Relaxed);
    metrics::counter!(crate::metrics::DEFINITIONS_COMPILED).increment(1);
    // A row whose hash is not its body's (edited by hand) is compiled on every load.
    if def.hash() == hash {
        cache.put(&def, body.len());
    }
    Ok(def)
}

/// Compiled definitions by (name, version), least recently used out first, bounded by
/// [`DEFINITION_CACHE_ENTRIES_MAX`] and [`DEFINITION_CACHE_BYTES_MAX`]. A hash is the sha256
/// of the normalised document, so a copy whose hash is the row's is that row compiled.
#[derive(Default)]
pub(crate) struct DefinitionCache {
    entries: Mutex<Entries>,
    compiled: AtomicU64,
}

#[derive(Default)]
struct Entries {
    by_key: HashMap<(String, u32), Entry>,
    bytes: usize,
    clock: u64,
}

struct Entry {
    def: Definition,
    bytes: usize,
    used: u64,
}

impl DefinitionCache {
    /// The compiled copies held of `name`'s versions.
    fn held(&self, name: &str) -> Vec<Definition> {
        let Ok(entries) = self.entries.lock() else {
            return Vec::new();
        };
        entries
            .by_key
            .iter()
            .filter(|((n, _), _)| n == name)
            .map(|(_, e)| e.def.clone())
            .collect()
    }

    /// Marks the copy of `def` as just used.
    fn touch(&self, def: &Definition) {
        let Ok(mut entries) = self.entries.lock() else {
            return;
        };
        entries.clock += 1;
        let now = entries.clock;
        if let Some(e) = entries
            .by_key
            .get_mut(&(def.name().to_owned(), def.version()))
        {
            e.used = now;
        }
    }

    /// Keeps `def`, compiled from `bytes` of stored text, evicting the least recently used.
    fn put(&self, def: &Definition, bytes: usize) {
        if bytes > DEFINITION_CACHE_BYTES_MAX {
            return;
        }
        let Ok(mut entries) = self.entries.lock() else {
            return;
        };
        entries.clock += 1;
        let used = entries.clock;
        let key = (def.name().to_owned(), def.version());
        let entry = Entry {
            def: def.clone(),
            bytes,
            used,
        };
        if let Some(old) = entries.by_key.insert(key, entry) {
            entries.bytes -= old.bytes;
        }
        entries.bytes += bytes;
        while entries.by_key.len() > DEFINITION_CACHE_ENTRIES_MAX
            || entries.bytes > DEFINITION_CACHE_BYTES_MAX
        {
            let Some(oldest) = entries
                .by_key
                .iter()
                .min_by_key(|(_, e)| e.used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            if let Some(gone) = entries.by_key.remove(&oldest) {
                entries.bytes -= gone.bytes;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbered(version: u32) -> Definition {
        let text = rein_core::builtin::source_at_version("chain4", version).expect("chain4");
        Definition::parse(
            &text,
            rein_core::Format::Toml,
            &rein_core::GuardRegistry::new(),
        )
        .expect("valid")
    }

    #[test]
    fn the_least_recently_used_copy_leaves_first_when_the_entries_are_full() {
        let cache = DefinitionCache::default();
        for v in 1..=DEFINITION_CACHE_ENTRIES_MAX as u32 {
            cache.put(&numbered(v), 10);
        }
        assert_eq!(cache.held("chain4").len(), DEFINITION_CACHE_ENTRIES_MAX);
        // Version 1 was used again, so version 2 is now the oldest.
        cache.touch(&numbered(1));
        cache.put(&numbered(10_000), 10);
        let held: Vec<u32> = cache.held("chain4").iter().map(|d| d.version()).collect();
        assert_eq!(held.len(), DEFINITION_CACHE_ENTRIES_MAX);
        assert!(held.contains(&1) && held.contains(&10_000), "{held:?}");
        assert!(!held.contains(&2), "{held:?}");
    }

    #[test]
    fn the_byte_bound_evicts_and_a_copy_larger_than_it_is_not_kept() {
        let cache = DefinitionCache::default();
        cache.put(&numbered(1), DEFINITION_CACHE_BYTES_MAX / 2);
        cache.put(&numbered(2), DEFINITION_CACHE_BYTES_MAX / 2);
        cache.put(&numbered(3), 1);
        let held: Vec<u32> = cache.held("chain4").iter().map(|d| d.version()).collect();
        assert_eq!(held.len(), 2, "{held:?}");
        assert!(!held.contains(&1), "{held:?}");
        cache.put(&numbered(4), DEFINITION_CACHE_BYTES_MAX + 1);
        assert!(cache.held("chain4").iter().all(|d| d.version() != 4));
        let bytes = cache.entries.lock().unwrap().bytes;
        assert!(bytes <= DEFINITION_CACHE_BYTES_MAX, "{bytes}");
    }
}
