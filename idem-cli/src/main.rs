//! `idem`: the command-line tool of the idem workspace. See README.md.

#![forbid(unsafe_code)]

/// `println!` for the tool's output, through [`write_out`].
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::write_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod bench;
mod cli;
mod confirm;
#[cfg(feature = "kafka")]
mod demo;
#[cfg(feature = "kafka")]
mod dlq;
mod error;
mod offsets;
mod ops;
mod show;
mod target;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::Parser;

use crate::cli::{Cli, Command};
use crate::error::Result;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idem: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) if STDOUT_FAILED.load(Ordering::Relaxed) => ExitCode::FAILURE,
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idem: {}", one_line(&e));
            ExitCode::from(e.exit_code())
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    match cli.command {
        #[cfg(feature = "kafka")]
        Command::Demo(a) => demo::run(&a).await,
        #[cfg(not(feature = "kafka"))]
        Command::Demo(_) => Err(error::Error::FeatureMissing {
            what: "idem demo".into(),
            feature: "kafka",
        }),
        Command::Bench(a) => bench::run(&a).await,
        Command::Inspect(a) => ops::inspect(&a).await,
        Command::List(a) => ops::list(&a).await,
        Command::Release(a) => ops::release(&a).await,
        Command::Delete(a) => ops::delete(&a).await,
        Command::Purge(a) => ops::purge(&a).await,
        Command::Migrate(a) => ops::migrate(&a).await,
        Command::Offsets(a) => offsets::run(&a).await,
        Command::Backends => {
            out!("{}", target::listing());
            Ok(())
        }
        #[cfg(feature = "kafka")]
        Command::Dlq(a) => dlq::run(a).await,
        #[cfg(not(feature = "kafka"))]
        Command::Dlq(_) => Err(error::Error::FeatureMissing {
            what: "idem dlq".into(),
            feature: "kafka",
        }),
    }
}

/// Set once standard output could not be written: nothing more is written to it.
static STDOUT_GONE: AtomicBool = AtomicBool::new(false);
/// Set when that was an error other than a reader that went away.
static STDOUT_FAILED: AtomicBool = AtomicBool::new(false);

/// Writes the tool's output. A reader that went away (`idem list --json | head -1`) stops
/// the output, not the command: it runs to its end, and its own result decides the exit
/// status, as a writer in a shell pipeline that ignores `SIGPIPE` does. Any other failure
/// to write is reported once and makes the exit status a failure.
fn write_out(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    if STDOUT_GONE.load(Ordering::Relaxed) {
        return;
    }
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_fmt(args).and_then(|()| stdout.flush()) {
        STDOUT_GONE.store(true, Ordering::Relaxed);
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            eprintln!("idem: writing to standard output: {e}");
            STDOUT_FAILED.store(true, Ordering::Relaxed);
        }
    }
}

/// The error and its causes below the first (which its own text already includes), on one
/// line.
fn one_line(e: &error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e).and_then(std::error::Error::source);
    while let Some(c) = cause {
        let more = c.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    text.replace('\n', " ")
}
