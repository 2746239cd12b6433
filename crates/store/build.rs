fn main() {
    // `sqlx::migrate!` embeds migrations/ at build time: a migration added, changed or
    // removed there must rebuild the crate, or a binary would ship an older schema.
    println!("cargo:rerun-if-changed=../../migrations");
    println!("cargo:rerun-if-changed=../../migrations/contract");
}
