//! A private PostgreSQL cluster built from the machine's installed server
//! binaries, so tests and local development need no pre-provisioned database or
//! container runtime. Unix only; synchronous because it runs before any async
//! runtime exists and is dominated by process start-up anyway.

mod bin_dir;
mod error;
mod server;
mod testdb;

pub use bin_dir::{find_pg_bin_dir, find_pg_bin_dir_in};
pub use error::DevDbError;
pub use server::{PrivatePostgres, PrivatePostgresOptions, Relocated};
pub use testdb::{replace_database, test_database};
