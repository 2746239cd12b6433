//! `rein tokens create`: API bearer tokens with scopes (SPEC Z1), made against the database
//! directly. The secret is printed once, alone on stdout; only its hash is stored.

use rein_store::{SCOPES, check_token_request};

use crate::{DbArgs, exit, ops};

#[derive(clap::Subcommand)]
pub enum TokensCommand {
    /// Create a token; prints its secret alone on stdout (shown only this once).
    Create(CreateArgs),
    /// Revoke a token by its id (printed on stderr when it was created): the API refuses it
    /// from now on.
    Revoke(RevokeArgs),
}

#[derive(clap::Args)]
pub struct RevokeArgs {
    #[command(flatten)]
    db: DbArgs,
    token_id: uuid::Uuid,
}

#[derive(clap::Args)]
pub struct CreateArgs {
    #[command(flatten)]
    db: DbArgs,
    /// A scope the token grants: read, enqueue, approve, operate or admin (admin implies
    /// all). Repeat for several.
    #[arg(long = "scope", value_name = "SCOPE", required = true)]
    scopes: Vec<String>,
    /// Who the token speaks for (recorded as the approver of its decisions), 1..=128 bytes.
    #[arg(long, value_name = "NAME")]
    subject: String,
}

pub async fn tokens(cmd: TokensCommand) -> u8 {
    match cmd {
        TokensCommand::Create(args) => create(args).await,
        TokensCommand::Revoke(args) => revoke(args).await,
    }
}

async fn revoke(args: RevokeArgs) -> u8 {
    let store = match ops::connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    match store.revoke_token(args.token_id).await {
        Ok(true) => {
            println!("revoked token {}", args.token_id);
            exit::OK
        }
        Ok(false) => {
            eprintln!(
                "error: no live token {} (unknown, or already revoked)",
                args.token_id
            );
            exit::INPUT
        }
        Err(e) => ops::report(&e),
    }
}

async fn create(args: CreateArgs) -> u8 {
    if let Err(e) = check_token_request(&args.subject, &args.scopes) {
        eprintln!("error: {e}");
        return exit::INPUT;
    }
    let store = match ops::connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    match store.create_token(&args.subject, &args.scopes).await {
        Ok((token_id, secret)) => {
            println!("{secret}");
            eprintln!(
                "created token {token_id} for `{}` with scopes {} (of {}); the secret above is not shown again",
                args.subject,
                args.scopes.join(", "),
                SCOPES.join(", ")
            );
            exit::OK
        }
        Err(e) => ops::report(&e),
    }
}
