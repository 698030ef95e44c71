//! One seed of the deterministic simulator: the whole engine on one thread, on a
//! simulated clock and disk, with the seed's crashes and faults, judged by a history
//! checker (see `proctor::simulation`).
//!
//! ```text
//! cargo run --release --features simulation --example simulate -- --seed 7
//! cargo run --release --features simulation --example simulate -- --seed 7 --trace
//! cargo run --release --features simulation --example simulate -- --mutate list
//! cargo run --release --features simulation --example simulate -- --seeds 1000 --mutate wal-no-sync
//! PROCTOR_SIM_SECS=3600 cargo run --release --features simulation --example simulate -- --seed 1
//! ```
//!
//! One seed prints one JSON line (`seed`, `trace_hash`, `violations`, `crashes`,
//! `faults`, ...) and exits 1 if the checker found a violation, with the command that
//! replays it on standard error. `--seeds N` runs seeds `--seed` to `--seed + N - 1`
//! and prints a line for each seed that failed and a summary line; `PROCTOR_SIM_SECS`
//! keeps running consecutive seeds from `--seed` for that many seconds.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use proctor::simulation::{run, Mutation, Options};

#[derive(Parser)]
#[command(about = "Runs seeds of proctor's deterministic simulation")]
struct Args {
    /// The seed (the first one, with --seeds).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// How many consecutive seeds to run.
    #[arg(long)]
    seeds: Option<u64>,
    /// Roots in each seed's workload.
    #[arg(long, default_value_t = 50)]
    roots: usize,
    /// A deliberately reintroduced bug (`list` prints their names).
    #[arg(long)]
    mutate: Option<String>,
    /// Print the seed's whole history, one event a line, before its JSON line.
    #[arg(long)]
    trace: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mutation = match args.mutate.as_deref() {
        None => None,
        Some("list") => {
            for m in Mutation::ALL {
                println!("{}", m.name());
            }
            return ExitCode::SUCCESS;
        }
        Some(name) => match Mutation::from_name(name) {
            Some(m) => Some(m),
            None => {
                eprintln!("unknown mutation {name:?}; `--mutate list` prints them");
                return ExitCode::from(2);
            }
        },
    };
    let options = Options {
        roots: args.roots,
        mutation,
        trace: args.trace,
    };
    let budget = std::env::var("PROCTOR_SIM_SECS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_secs);
    if args.seeds.is_none() && budget.is_none() {
        let outcome = run(args.seed, &options);
        for line in &outcome.trace {
            println!("{line}");
        }
        println!("{}", outcome.json());
        if outcome.violations.is_empty() {
            return ExitCode::SUCCESS;
        }
        for v in &outcome.violations {
            eprintln!("violation: {v}");
        }
        eprintln!("replay: {}", replay(args.seed, &args));
        return ExitCode::FAILURE;
    }
    let started = Instant::now();
    let (mut ran, mut failed) = (0u64, 0u64);
    let mut seed = args.seed;
    loop {
        let more = match (args.seeds, budget) {
            (Some(n), _) => ran < n,
            (None, Some(b)) => started.elapsed() < b,
            (None, None) => false,
        };
        if !more {
            break;
        }
        let outcome = run(seed, &options);
        ran += 1;
        if !outcome.violations.is_empty() {
            failed += 1;
            println!("{}", outcome.json());
            eprintln!("replay: {}", replay(seed, &args));
        }
        seed += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{{\"seeds\":{ran},\"failed\":{failed},\"seconds\":{secs:.1},\"seeds_per_minute\":{:.0}}}",
        ran as f64 * 60.0 / secs.max(1e-9)
    );
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn replay(seed: u64, args: &Args) -> String {
    let mut cmd = format!(
        "cargo run --release --features simulation --example simulate -- --seed {seed} --roots {} --trace",
        args.roots
    );
    if let Some(m) = &args.mutate {
        cmd.push_str(&format!(" --mutate {m}"));
    }
    cmd
}
