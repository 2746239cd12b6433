//! The operator operations, once (SPEC I3, Z1): what the API's handlers and the CLI's
//! commands both do — enqueue, send, cancel, rerun, runs, history, approvals, definitions,
//! workers, `why`, the resume brief, what-if replays, verifying a log, resolving an in-doubt call, limits, following a run to its end. Each takes a [`rein_store::Store`] and the acting identity and returns a
//! view (a JSON document or a typed value) or an [`Error`] with a stable [`Code`]: the API
//! maps the code to an HTTP status, the CLI to an exit code. Nothing here prints, speaks HTTP
//! or parses a command line.

mod definition_file;
pub mod error;
pub mod moves;
pub mod paging;
pub mod recovery;
pub mod schema;
pub mod service;
pub mod stream;
pub mod usage;
pub mod whatif;
pub mod why;

pub use definition_file::{load_definition, read_file_limited};
pub use error::{Code, Error, ErrorBody, ErrorDetail};
