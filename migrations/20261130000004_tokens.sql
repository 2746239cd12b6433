-- API bearer tokens (SPEC Z1). Only the SHA-256 of a token's secret is stored; the secret is
-- shown once, when the token is created.
CREATE TABLE rein_tokens (
    token_id    uuid        PRIMARY KEY,
    subject     text        NOT NULL CHECK (octet_length(subject) BETWEEN 1 AND 128),
    scopes      text[]      NOT NULL,
    token_hash  text        NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    revoked_at  timestamptz
);
