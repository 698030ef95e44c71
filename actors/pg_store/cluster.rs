//! The tables and statements of a cluster of executors on one PostgreSQL store.
//!
//! - `proctor_partitions`: one row per partition, made when the cluster is created:
//!   its owner (a member's name), its epoch (bumped by every change of owner and by
//!   every engine start: the partition's fencing token), a hand-off the coordinator
//!   asked for (`wanted`), and the partition's bookkeeping (highest id, stop mark), which
//!   the whole store keeps in `proctor_meta`.
//! - `proctor_members`: one row per executor that ever joined: its membership, a lease
//!   renewed as the leader lease is ([`PgLease::member`](super::PgLease)).
//! - `proctor_moves`: every change of owner, for operators.
//! - `proctor_inbox`: submits forwarded to a partition's owner: a member that does not
//!   own a root's partition writes the root here; the owner submits it and writes back
//!   its id.
//! - `proctor_procs.part`: the partition of each procedure's row (`NULL` in a store of
//!   one engine); a partition's batch statement is the whole store's (`write_sql`
//!   there), fenced with the partition's row.
//!
//! Every statement that changes ownership is checked by the database against the
//! database's clock: a partition leaves a member only when that member's membership
//! has expired, or by that member's own hand-off; the coordinator's moves are fenced
//! with its leader lease's epoch.

use postgres::{Client, NoTls};

use super::{check_identifier, describe, PgOptions};
use crate::procedure::ProcId;
use crate::store::StoreError;

/// The cluster's tables, made beside the store's (see the module docs).
pub(super) fn schema_sql(schema: &str) -> String {
    format!(
        "ALTER TABLE {schema}.proctor_procs ADD COLUMN IF NOT EXISTS part integer;
         CREATE INDEX IF NOT EXISTS proctor_procs_part ON {schema}.proctor_procs (part);
         CREATE TABLE IF NOT EXISTS {schema}.proctor_partitions (
             part integer PRIMARY KEY,
             owner text,
             epoch bigint NOT NULL,
             wanted text,
             max_id bigint NOT NULL,
             drained boolean NOT NULL,
             cut_off bigint[] NOT NULL,
             moves bigint NOT NULL,
             moved_at timestamptz
         );
         CREATE TABLE IF NOT EXISTS {schema}.proctor_members (
             name text PRIMARY KEY,
             epoch bigint NOT NULL,
             expires_at timestamptz,
             joined_at timestamptz NOT NULL
         );
         CREATE TABLE IF NOT EXISTS {schema}.proctor_moves (
             seq bigserial PRIMARY KEY,
             at timestamptz NOT NULL DEFAULT now(),
             part integer NOT NULL,
             from_owner text,
             to_owner text,
             epoch bigint NOT NULL,
             reason text NOT NULL
         );
         CREATE TABLE IF NOT EXISTS {schema}.proctor_inbox (
             nonce_group bigint NOT NULL,
             nonce bigint NOT NULL,
             part integer NOT NULL,
             type_name text NOT NULL,
             state bytea NOT NULL,
             submitted_at timestamptz NOT NULL DEFAULT now(),
             id bigint,
             error text,
             PRIMARY KEY (nonce_group, nonce)
         );"
    )
}

/// One partition as the cluster's table has it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartitionState {
    /// The partition.
    pub partition: u32,
    /// The member that owns it, if any.
    pub owner: Option<String>,
    /// Its epoch: its owner's fencing token.
    pub epoch: i64,
    /// A hand-off the coordinator asked its owner for, to this member.
    pub wanted: Option<String>,
    /// How many times it changed owner.
    pub moves: i64,
}

/// One member of a cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MemberState {
    /// Its name.
    pub name: String,
    /// Its membership's epoch (bumped at each join).
    pub epoch: i64,
    /// How long its membership has to run, by the database's clock; `None` once it
    /// expired (a member that left or died).
    pub remaining: Option<std::time::Duration>,
}

/// A change of a partition's owner.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct MoveRecord {
    /// When, in ms since the Unix epoch (the database's clock).
    pub at_ms: i64,
    /// The partition.
    pub partition: u32,
    /// Its owner before, if any.
    pub from: Option<String>,
    /// Its owner after, if any.
    pub to: Option<String>,
    /// Its epoch after.
    pub epoch: i64,
    /// Why: `assigned` (it had no owner), `dead` (its owner's membership expired),
    /// `hand-off` (balance), `left` (its owner let it go).
    pub reason: String,
}

/// A cluster as its tables have it: the operator's view.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClusterState {
    /// Every partition.
    pub partitions: Vec<PartitionState>,
    /// Every member that ever joined.
    pub members: Vec<MemberState>,
    /// The coordinator (the leader lease's holder), if its lease is live.
    pub coordinator: Option<String>,
    /// The newest changes of owner, newest first (at most 50).
    pub recent_moves: Vec<MoveRecord>,
    /// How many changes of owner there were that moved a partition from one member to
    /// another (`dead`, `hand-off` and `left`), in all.
    pub moves: i64,
}

/// A submit forwarded to a partition's owner.
#[derive(Debug)]
pub(crate) struct Forwarded {
    pub(crate) nonce: crate::record::Nonce,
    pub(crate) partition: u32,
    pub(crate) type_name: String,
    pub(crate) state: Vec<u8>,
}

/// What became of a forwarded submit.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ForwardState {
    /// Its owner has not taken it yet.
    Waiting,
    /// Its owner submitted it: the root's id.
    Submitted(ProcId),
    /// Its owner refused it.
    Refused(String),
}

/// A root's row as another member reads it.
#[derive(Debug)]
pub(crate) enum RootRow {
    /// No row: never written, or evicted.
    Missing,
    /// The root's record.
    Found(Box<crate::record::ProcRecord>),
}

fn db_error(context: &str, e: &postgres::Error) -> StoreError {
    StoreError::Database {
        context: context.to_string(),
        reason: describe(e),
    }
}

fn to_u32(n: i32) -> u32 {
    u32::try_from(n).unwrap_or(0)
}

fn as_i32(n: u32) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

fn as_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// A member's connection to the cluster's tables (blocking: the member's cluster
/// thread holds it).
pub(crate) struct ClusterDb {
    url: String,
    schema: String,
    client: Option<Client>,
}

impl ClusterDb {
    pub(crate) fn new(url: &str, options: &PgOptions) -> Result<ClusterDb, StoreError> {
        check_identifier(options.schema_name())?;
        Ok(ClusterDb {
            url: url.to_string(),
            schema: options.schema_name().to_string(),
            client: None,
        })
    }

    /// The connection, made anew after a failure.
    fn client(&mut self) -> Result<&mut Client, StoreError> {
        if self.client.is_none() {
            let mut config: postgres::Config =
                self.url
                    .parse()
                    .map_err(|e: postgres::Error| StoreError::Database {
                        context: "connecting to PostgreSQL for the cluster".to_string(),
                        reason: describe(&e),
                    })?;
            if config.get_application_name().is_none() {
                config.application_name("proctor cluster");
            }
            if config.get_connect_timeout().is_none() {
                config.connect_timeout(std::time::Duration::from_secs(2));
            }
            let client = config
                .connect(NoTls)
                .map_err(|e| db_error("connecting to PostgreSQL for the cluster", &e))?;
            self.client = Some(client);
        }
        self.client
            .as_mut()
            .ok_or_else(|| StoreError::Failed("no connection".to_string()))
    }

    /// Runs `call`; a failure drops the connection, so the next call makes a new one.
    fn with<T>(
        &mut self,
        call: impl FnOnce(&mut Client, &str) -> Result<T, postgres::Error>,
        context: &str,
    ) -> Result<T, StoreError> {
        let schema = self.schema.clone();
        let client = self.client()?;
        call(client, &schema).map_err(|e| {
            self.client = None;
            db_error(context, &e)
        })
    }

    /// Makes the store's tables and, in a store without them, `count` partitions;
    /// returns the cluster's number of partitions (the existing one wins).
    pub(crate) fn create(&mut self, count: u32) -> Result<u32, StoreError> {
        {
            let schema = self.schema.clone();
            let client = self.client()?;
            super::create_schema(client, &schema).map_err(|f| f.error)?;
        }
        let count = i32::try_from(count.clamp(1, 4096)).unwrap_or(1);
        let made = self.with(
            |c, schema| {
                let mut tx = c.transaction()?;
                tx.execute(
                    "SELECT pg_advisory_xact_lock(hashtext('proctor cluster ' || $1))",
                    &[&schema],
                )?;
                let existing: i64 = tx
                    .query_one(
                        &format!("SELECT count(*) FROM {schema}.proctor_partitions"),
                        &[],
                    )?
                    .get(0);
                let unpartitioned: i64 = tx
                    .query_one(
                        &format!("SELECT count(*) FROM {schema}.proctor_procs WHERE part IS NULL"),
                        &[],
                    )?
                    .get(0);
                if existing == 0 && unpartitioned == 0 {
                    tx.execute(
                        &format!(
                            "INSERT INTO {schema}.proctor_partitions
                             SELECT g, NULL, 0, NULL, 0, false, '{{}}', 0, NULL
                             FROM generate_series(0, $1 - 1) g"
                        ),
                        &[&count],
                    )?;
                }
                tx.commit()?;
                Ok((existing, unpartitioned))
            },
            "creating the cluster's partitions",
        )?;
        match made {
            (0, 0) => Ok(u32::try_from(count).unwrap_or(1)),
            (0, rows) => Err(StoreError::Database {
                context: "creating a cluster".to_string(),
                reason: format!(
                    "schema {:?} holds {rows} procedures of a single engine: a cluster needs \
                     a schema of its own (PgOptions::schema)",
                    self.schema
                ),
            }),
            (existing, _) => Ok(u32::try_from(existing).unwrap_or(1)),
        }
    }

    /// Every partition's owner, epoch and pending hand-off, by partition.
    pub(crate) fn partitions(&mut self) -> Result<Vec<PartitionState>, StoreError> {
        self.with(
            |c, schema| {
                let rows = c.query(
                    &format!(
                        "SELECT part, owner, epoch, wanted, moves
                         FROM {schema}.proctor_partitions ORDER BY part"
                    ),
                    &[],
                )?;
                Ok(rows
                    .iter()
                    .map(|r| PartitionState {
                        partition: to_u32(r.get(0)),
                        owner: r.get(1),
                        epoch: r.get(2),
                        wanted: r.get(3),
                        moves: r.get(4),
                    })
                    .collect())
            },
            "reading the cluster's partitions",
        )
    }

    /// The members whose membership is live, by the database's clock.
    pub(crate) fn live_members(&mut self) -> Result<Vec<String>, StoreError> {
        self.with(
            |c, schema| {
                let rows = c.query(
                    &format!(
                        "SELECT name FROM {schema}.proctor_members WHERE expires_at > now()
                         ORDER BY name"
                    ),
                    &[],
                )?;
                Ok(rows.iter().map(|r| r.get(0)).collect())
            },
            "reading the cluster's members",
        )
    }

    /// The coordinator's moves, each in a transaction fenced with its leader lease
    /// (`holder` at `epoch`): `false` if the lease is no longer its own. An assignment
    /// takes a partition only from an owner whose membership has expired.
    pub(crate) fn apply(
        &mut self,
        holder: &str,
        epoch: i64,
        moves: &[crate::cluster::Move],
    ) -> Result<bool, StoreError> {
        self.with(
            |c, schema| {
                for m in moves {
                    let mut tx = c.transaction()?;
                    let fenced = tx
                        .query_opt(
                            &format!(
                                "SELECT 1 FROM {schema}.proctor_lease
                                 WHERE id = 1 AND holder = $1 AND epoch = $2 FOR SHARE"
                            ),
                            &[&holder, &epoch],
                        )?
                        .is_none();
                    if fenced {
                        return Ok(false);
                    }
                    match m {
                        crate::cluster::Move::Assign { partition, to } => {
                            let part = as_i32(*partition);
                            let moved = tx.query_opt(
                                &format!(
                                    "WITH old AS (
                                         SELECT owner FROM {schema}.proctor_partitions
                                         WHERE part = $1 FOR UPDATE
                                     )
                                     UPDATE {schema}.proctor_partitions p
                                     SET owner = $2, wanted = NULL, epoch = p.epoch + 1,
                                         moves = p.moves + (old.owner IS NOT NULL)::int,
                                         moved_at = now()
                                     FROM old
                                     WHERE p.part = $1
                                       AND (old.owner IS NULL OR NOT EXISTS (
                                           SELECT 1 FROM {schema}.proctor_members m
                                           WHERE m.name = old.owner AND m.expires_at > now()))
                                       AND EXISTS (
                                           SELECT 1 FROM {schema}.proctor_members m
                                           WHERE m.name = $2 AND m.expires_at > now())
                                     RETURNING old.owner, p.epoch"
                                ),
                                &[&part, to],
                            )?;
                            if let Some(row) = moved {
                                let from: Option<String> = row.get(0);
                                let reason = if from.is_some() { "dead" } else { "assigned" };
                                tx.execute(
                                    &format!(
                                        "INSERT INTO {schema}.proctor_moves
                                         (part, from_owner, to_owner, epoch, reason)
                                         VALUES ($1, $2, $3, $4, $5)"
                                    ),
                                    &[&part, &from, to, &row.get::<_, i64>(1), &reason],
                                )?;
                            }
                        }
                        crate::cluster::Move::HandOff { partition, to } => {
                            tx.execute(
                                &format!(
                                    "UPDATE {schema}.proctor_partitions SET wanted = $2
                                     WHERE part = $1 AND owner IS NOT NULL AND owner <> $2"
                                ),
                                &[&as_i32(*partition), to],
                            )?;
                        }
                    }
                    tx.commit()?;
                }
                Ok(true)
            },
            "moving partitions",
        )
    }

    /// Claims partition `partition`, owned by `member` (at membership `member_epoch`),
    /// for a new engine: its epoch bumped, so whatever an earlier engine of it still
    /// has on its way is fenced. `None` if it is not `member`'s (any more), or the
    /// membership has expired.
    pub(crate) fn claim(
        &mut self,
        partition: u32,
        member: &str,
        member_epoch: i64,
    ) -> Result<Option<i64>, StoreError> {
        self.with(
            |c, schema| {
                let row = c.query_opt(
                    &format!(
                        "UPDATE {schema}.proctor_partitions SET epoch = epoch + 1
                         WHERE part = $1 AND owner = $2 AND EXISTS (
                             SELECT 1 FROM {schema}.proctor_members m
                             WHERE m.name = $2 AND m.epoch = $3 AND m.expires_at > now())
                         RETURNING epoch"
                    ),
                    &[&as_i32(partition), &member, &member_epoch],
                )?;
                Ok(row.map(|r| r.get(0)))
            },
            "claiming a partition",
        )
    }

    /// Gives partition `partition`, owned by `member` at `epoch`, to the member the
    /// coordinator asked for (`wanted`), or lets it go (`to` `None`: the member leaves),
    /// after its engine stopped. `false` if it was not `member`'s at `epoch` any more.
    pub(crate) fn hand_off(
        &mut self,
        partition: u32,
        member: &str,
        epoch: i64,
        leaving: bool,
    ) -> Result<bool, StoreError> {
        self.with(
            |c, schema| {
                let mut tx = c.transaction()?;
                let part = as_i32(partition);
                let moved = tx.query_opt(
                    &format!(
                        "UPDATE {schema}.proctor_partitions
                         SET owner = CASE WHEN $4 THEN NULL ELSE wanted END, wanted = NULL,
                             epoch = epoch + 1, moves = moves + 1, moved_at = now()
                         WHERE part = $1 AND owner = $2 AND epoch = $3
                           AND ($4 OR wanted IS NOT NULL)
                         RETURNING owner, epoch"
                    ),
                    &[&part, &member, &epoch, &leaving],
                )?;
                let Some(row) = moved else {
                    return Ok(false);
                };
                let to: Option<String> = row.get(0);
                let reason = if leaving { "left" } else { "hand-off" };
                tx.execute(
                    &format!(
                        "INSERT INTO {schema}.proctor_moves (part, from_owner, to_owner, epoch, reason)
                         VALUES ($1, $2, $3, $4, $5)"
                    ),
                    &[&part, &member, &to, &row.get::<_, i64>(1), &reason],
                )?;
                tx.commit()?;
                Ok(true)
            },
            "handing a partition off",
        )
    }

    /// Writes a submit for the owner of its partition; a nonce written before keeps
    /// the first (a retry).
    pub(crate) fn forward(&mut self, f: &Forwarded) -> Result<(), StoreError> {
        self.with(
            |c, schema| {
                c.execute(
                    &format!(
                        "INSERT INTO {schema}.proctor_inbox
                         (nonce_group, nonce, part, type_name, state) VALUES ($1, $2, $3, $4, $5)
                         ON CONFLICT DO NOTHING"
                    ),
                    &[
                        &(f.nonce.group as i64),
                        &(f.nonce.nonce as i64),
                        &as_i32(f.partition),
                        &f.type_name,
                        &f.state,
                    ],
                )?;
                Ok(())
            },
            "forwarding a submit",
        )
    }

    /// What became of the forwarded submits of `nonces`; a settled one is deleted.
    pub(crate) fn forwarded(
        &mut self,
        nonces: &[crate::record::Nonce],
    ) -> Result<Vec<(crate::record::Nonce, ForwardState)>, StoreError> {
        let groups: Vec<i64> = nonces.iter().map(|n| n.group as i64).collect();
        let ns: Vec<i64> = nonces.iter().map(|n| n.nonce as i64).collect();
        self.with(
            |c, schema| {
                let rows = c.query(
                    &format!(
                        "SELECT nonce_group, nonce, id, error FROM {schema}.proctor_inbox
                         WHERE (nonce_group, nonce) IN (SELECT * FROM UNNEST($1::bigint[], $2::bigint[]))"
                    ),
                    &[&groups, &ns],
                )?;
                let mut out = Vec::with_capacity(rows.len());
                let (mut done_g, mut done_n) = (Vec::new(), Vec::new());
                for r in rows {
                    let (g, n): (i64, i64) = (r.get(0), r.get(1));
                    let id: Option<i64> = r.get(2);
                    let error: Option<String> = r.get(3);
                    let state = match (id, error) {
                        (Some(id), _) => ForwardState::Submitted(ProcId(u64::try_from(id).unwrap_or(0))),
                        (None, Some(e)) => ForwardState::Refused(e),
                        (None, None) => ForwardState::Waiting,
                    };
                    if state != ForwardState::Waiting {
                        done_g.push(g);
                        done_n.push(n);
                    }
                    let nonce = crate::record::Nonce {
                        group: g as u64,
                        nonce: n as u64,
                    };
                    out.push((nonce, state));
                }
                if !done_g.is_empty() {
                    c.execute(
                        &format!(
                            "DELETE FROM {schema}.proctor_inbox
                             WHERE (nonce_group, nonce) IN (SELECT * FROM UNNEST($1::bigint[], $2::bigint[]))"
                        ),
                        &[&done_g, &done_n],
                    )?;
                }
                Ok(out)
            },
            "reading forwarded submits",
        )
    }

    /// The submits forwarded to `partitions` that their owner has not taken yet.
    pub(crate) fn inbox(&mut self, partitions: &[u32]) -> Result<Vec<Forwarded>, StoreError> {
        let parts: Vec<i32> = partitions.iter().map(|&p| as_i32(p)).collect();
        self.with(
            |c, schema| {
                let rows = c.query(
                    &format!(
                        "SELECT nonce_group, nonce, part, type_name, state FROM {schema}.proctor_inbox
                         WHERE id IS NULL AND error IS NULL AND part = ANY($1)
                         ORDER BY submitted_at LIMIT 1000"
                    ),
                    &[&parts],
                )?;
                Ok(rows
                    .iter()
                    .map(|r| Forwarded {
                        nonce: crate::record::Nonce {
                            group: r.get::<_, i64>(0) as u64,
                            nonce: r.get::<_, i64>(1) as u64,
                        },
                        partition: to_u32(r.get(2)),
                        type_name: r.get(3),
                        state: r.get(4),
                    })
                    .collect())
            },
            "reading the cluster's inbox",
        )
    }

    /// The owner's answers to forwarded submits: each root's id, or why it was refused.
    pub(crate) fn answer(
        &mut self,
        answers: &[(crate::record::Nonce, Option<Result<ProcId, String>>)],
    ) -> Result<(), StoreError> {
        self.with(
            |c, schema| {
                let statement = c.prepare(&format!(
                    "UPDATE {schema}.proctor_inbox SET id = $3, error = $4
                     WHERE nonce_group = $1 AND nonce = $2"
                ))?;
                for (nonce, answer) in answers {
                    let (id, error) = match answer {
                        Some(Ok(id)) => (Some(as_i64(id.0)), None),
                        Some(Err(e)) => (None, Some(e.as_str())),
                        // Not taken: left for a later poll.
                        None => continue,
                    };
                    c.execute(
                        &statement,
                        &[&(nonce.group as i64), &(nonce.nonce as i64), &id, &error],
                    )?;
                }
                Ok(())
            },
            "answering forwarded submits",
        )
    }

    /// The record of root `id`, as the store has it now.
    pub(crate) fn root(&mut self, id: ProcId) -> Result<RootRow, StoreError> {
        let row = self.with(
            |c, schema| {
                c.query_opt(
                    &format!("SELECT record FROM {schema}.proctor_procs WHERE id = $1"),
                    &[&as_i64(id.0)],
                )
            },
            "reading a root",
        )?;
        let Some(row) = row else {
            return Ok(RootRow::Missing);
        };
        let bytes: &[u8] = row.get(0);
        let record = rmp_serde::from_slice(bytes).map_err(|e| StoreError::Database {
            context: format!("reading procedure {id}"),
            reason: format!("its record does not decode: {e}"),
        })?;
        Ok(RootRow::Found(Box::new(record)))
    }

    /// The operator's view of the cluster; `None` if the store holds no cluster (no
    /// partitions, or no partitions table: a store an older proctor made, or no store).
    pub(crate) fn state(&mut self) -> Result<Option<ClusterState>, StoreError> {
        let table = self.with(
            |c, schema| {
                c.query_one(
                    "SELECT to_regclass($1)::text",
                    &[&format!("{schema}.proctor_partitions")],
                )
                .map(|row| row.get::<_, Option<String>>(0))
            },
            "reading the cluster's partitions",
        )?;
        if table.is_none() {
            return Ok(None);
        }
        let partitions = self.partitions()?;
        if partitions.is_empty() {
            return Ok(None);
        }
        self.with(
            |c, schema| {
                let members = c
                    .query(
                        &format!(
                            "SELECT name, epoch,
                                    CASE WHEN expires_at > now()
                                         THEN (EXTRACT(EPOCH FROM expires_at - now()) * 1000)::bigint
                                    END
                             FROM {schema}.proctor_members ORDER BY name"
                        ),
                        &[],
                    )?
                    .iter()
                    .map(|r| MemberState {
                        name: r.get(0),
                        epoch: r.get(1),
                        remaining: r.get::<_, Option<i64>>(2).map(|ms| {
                            std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0))
                        }),
                    })
                    .collect();
                let coordinator = c
                    .query_opt(
                        &format!(
                            "SELECT holder FROM {schema}.proctor_lease
                             WHERE id = 1 AND expires_at > now()"
                        ),
                        &[],
                    )?
                    .and_then(|r| r.get(0));
                let recent_moves = c
                    .query(
                        &format!(
                            "SELECT (EXTRACT(EPOCH FROM at) * 1000)::bigint, part, from_owner,
                                    to_owner, epoch, reason
                             FROM {schema}.proctor_moves ORDER BY seq DESC LIMIT 50"
                        ),
                        &[],
                    )?
                    .iter()
                    .map(|r| MoveRecord {
                        at_ms: r.get(0),
                        partition: to_u32(r.get(1)),
                        from: r.get(2),
                        to: r.get(3),
                        epoch: r.get(4),
                        reason: r.get(5),
                    })
                    .collect();
                let moves: i64 = c
                    .query_one(
                        &format!(
                            "SELECT count(*) FROM {schema}.proctor_moves WHERE reason <> 'assigned'"
                        ),
                        &[],
                    )?
                    .get(0);
                Ok(Some(ClusterState {
                    partitions,
                    members,
                    coordinator,
                    recent_moves,
                    moves,
                }))
            },
            "reading the cluster",
        )
    }

    /// How many roots of the cluster are unfinished, and how many forwarded submits
    /// wait for their owner.
    pub(crate) fn unfinished(&mut self) -> Result<(i64, i64), StoreError> {
        self.with(
            |c, schema| {
                let roots: i64 = c
                    .query_one(
                        &format!(
                            "SELECT count(*) FROM {schema}.proctor_procs
                             WHERE parent IS NULL AND part IS NOT NULL
                               AND state NOT IN ('SUCCESS', 'ROLLEDBACK')"
                        ),
                        &[],
                    )?
                    .get(0);
                let waiting: i64 = c
                    .query_one(
                        &format!(
                            "SELECT count(*) FROM {schema}.proctor_inbox
                             WHERE id IS NULL AND error IS NULL"
                        ),
                        &[],
                    )?
                    .get(0);
                Ok((roots, waiting))
            },
            "counting unfinished roots",
        )
    }
}
