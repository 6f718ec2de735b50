//! `sqlx::migrate!` embeds the migrations when the crate compiles: a new
//! migration file must recompile it (cargo watches directories' entries).

fn main() {
    println!("cargo:rerun-if-changed=migrations/sqlite");
    println!("cargo:rerun-if-changed=migrations/postgres");
}
