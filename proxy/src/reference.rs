//! `portcullis reference commands`: every command and flag as the
//! Markdown of docs/commands.md's reference section, made from the
//! command-line definitions themselves so the page cannot drift from
//! them (tests/docs.rs keeps the page equal to this output).

use std::fmt::Write as _;

use clap::CommandFactory;

use crate::cli::Cli;

/// The Markdown reference of every command and flag.
pub fn commands() -> String {
    let cli = Cli::command();
    let mut out = String::new();
    for command in cli.get_subcommands().filter(|c| !c.is_hide_set()) {
        let name = command.get_name();
        let _ = writeln!(out, "### `portcullis {name}`\n");
        if let Some(about) = command.get_long_about().or(command.get_about()) {
            let _ = writeln!(out, "{}\n", one_line(&about.to_string()));
        }
        let args: Vec<_> = command
            .get_arguments()
            .filter(|a| !a.is_hide_set() && !matches!(a.get_id().as_str(), "help" | "version"))
            .collect();
        if args.is_empty() {
            let _ = writeln!(out, "No flags.\n");
        } else {
            out.push_str("| flag | environment | default | what |\n|---|---|---|---|\n");
            for arg in args {
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} |",
                    cell(&flag(arg)),
                    arg.get_env()
                        .map(|e| format!("`{}`", e.to_string_lossy()))
                        .unwrap_or_default(),
                    default(arg),
                    cell(
                        &arg.get_long_help()
                            .or(arg.get_help())
                            .map(|h| h.to_string())
                            .unwrap_or_default()
                    ),
                );
            }
            out.push('\n');
        }
        if let Some(after) = command.get_after_help() {
            let example = after.to_string();
            let example = example.trim_start_matches("Example:").trim_matches('\n');
            let _ = writeln!(out, "```sh\n{}\n```\n", dedent(example));
        }
    }
    out.trim_end().to_owned() + "\n"
}

/// `--name VALUE` (or the positional `VALUE`), `(required)` when it is.
fn flag(arg: &clap::Arg) -> String {
    let value = arg
        .get_value_names()
        .and_then(|v| v.first())
        .map(|v| v.to_string())
        .unwrap_or_else(|| arg.get_id().as_str().to_uppercase());
    let takes_value = arg.get_num_args().is_none_or(|n| n.takes_values())
        && !matches!(arg.get_action(), clap::ArgAction::SetTrue);
    let text = match arg.get_long() {
        Some(long) if takes_value => format!("`--{long} {value}`"),
        Some(long) => format!("`--{long}`"),
        None => format!("`{value}`"),
    };
    if arg.is_required_set() {
        format!("{text} (required)")
    } else {
        text
    }
}

fn default(arg: &clap::Arg) -> String {
    let values: Vec<_> = arg
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy().into_owned())
        .collect();
    match values.as_slice() {
        [] => String::new(),
        // A switch's `false` says nothing a reader needs.
        [v] if v == "false" && matches!(arg.get_action(), clap::ArgAction::SetTrue) => {
            String::new()
        }
        _ => format!("`{}`", values.join(",")),
    }
}

/// Doc-comment text as one Markdown table cell.
fn cell(text: &str) -> String {
    one_line(text).replace('|', "\\|")
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn dedent(text: &str) -> String {
    text.lines()
        .map(|l| l.strip_prefix("  ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n")
}
