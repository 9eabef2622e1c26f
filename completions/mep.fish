# fish completion for mep(1). Installed in share/fish/vendor_completions.d.

# The words of the command line before the cursor that are not options or their values.
function __mep_words
    set -l valued --socket --config --ttl --wait --on-loss --grace --format --profile --db --listen \
        --tls-cert --tls-key --rate-limit --log-level --threads --tenant --limit --scope --input \
        --from-table --report --batch --isolation --db-pool --writer-nice --dir --token-file --control-plane \
        --max-object-size --ca-file --label --max-hold --name --host --expiring-within --server --since --reason \
        --memory --if-held
    set -l skip 0
    for w in (commandline -opc)[2..-1]
        if test $skip -eq 1
            set skip 0
        else if contains -- $w $valued
            set skip 1
        else if not string match -q -- '-*' $w
            echo $w
        end
    end
end

# True when no command has been given yet.
function __mep_no_command
    test (count (__mep_words)) -eq 0
end

# True when the command line has reached `mep CMD [SUB]`, e.g. __mep_using token create.
function __mep_using
    set -l words (__mep_words)
    test (count $words) -ge (count $argv); or return 1
    set -l i 0
    for a in $argv
        set i (math $i + 1)
        test "$words[$i]" = "$a"; or return 1
    end
end

# True when CMD (token, server, migrate, lease) has no subcommand yet.
function __mep_needs_sub
    set -l words (__mep_words)
    test (count $words) -eq 1; and test "$words[1]" = "$argv[1]"
end

function __mep_held_names
    mep status 2>/dev/null | awk 'NR > 1 { print $1 }'
end

# True when the cursor is on argument N of `mep CMD`, e.g. __mep_arg 2 fetch (its PATH).
function __mep_arg
    set -l words (__mep_words)
    test (count $words) -eq $argv[1]; and test "$words[1]" = "$argv[2]"
end

complete -c mep -f

# Global options (accepted before or after the command).
complete -c mep -s h -l help -d 'Print help and exit'
complete -c mep -l version -d 'Print the version and exit'
complete -c mep -l json -d 'Print one JSON document on stdout'
complete -c mep -s v -l verbose -d 'More output on stderr'
complete -c mep -l socket -r -F -d 'Path of the mepd socket'
complete -c mep -l config -r -F -d 'Config file'

# Commands.
complete -c mep -n __mep_no_command -a claim -d 'Claim NAME for the memory file PATH'
complete -c mep -n __mep_no_command -a run -d 'Run CMD while holding the lease on NAME for PATH'
complete -c mep -n __mep_no_command -a release -d 'Release the lease on NAME that mepd holds'
complete -c mep -n __mep_no_command -a init -d 'Create a new, empty memory file with a fresh identity'
complete -c mep -n __mep_no_command -a branch -d 'Copy a held memory to NEW_PATH as a new identity'
complete -c mep -n __mep_no_command -a status -d 'List the leases mepd keeps'
complete -c mep -n __mep_no_command -a identify -d 'Print the memory identity of a file'
complete -c mep -n __mep_no_command -a sync -d 'Upload the memory of the lease on NAME to the data plane'
complete -c mep -n __mep_no_command -a fetch -d 'Download a memory into a new file with its identity'
complete -c mep -n __mep_no_command -a lineage -d "Show a memory's ancestors and branches"
complete -c mep -n __mep_no_command -a config -d 'Show the effective configuration'
complete -c mep -n __mep_no_command -a canonicalize -d 'Print the canonical form and skeleton of names'
complete -c mep -n __mep_no_command -a token -d 'Create, list and revoke bearer tokens'
complete -c mep -n __mep_no_command -a server -d 'Run the control plane'
complete -c mep -n __mep_no_command -a store -d 'Run the data plane (a fenced object store)'
complete -c mep -n __mep_no_command -a migrate -d 'Bring legacy names and memories under the rules'
complete -c mep -n __mep_no_command -a lease -d "List, show and revoke the tenant's leases (control plane)"
complete -c mep -n __mep_no_command -a mcp -d 'Serve a memory file over the Model Context Protocol (stdio), fenced'

# claim, run: NAME (free-form), PATH (a file).
complete -c mep -n '__mep_using claim' -l ttl -x -d 'Lease TTL in seconds (5-300)'
complete -c mep -n '__mep_using claim' -l wait -x -a 'inf' -d 'Seconds to wait for a held name (0: fail at once; inf)'
complete -c mep -n '__mep_using claim' -l label -x -d 'KEY=VALUE shown to operators (repeat, at most 16)'
complete -c mep -n '__mep_using claim' -l max-hold -x -d 'Longest the lease may be held, in seconds'
complete -c mep -n '__mep_using claim' -F
complete -c mep -n '__mep_using run' -l ttl -x -d 'Lease TTL in seconds (5-300)'
complete -c mep -n '__mep_using run' -l wait -x -a 'inf' -d 'Seconds to wait for a held name (0: fail at once; inf)'
complete -c mep -n '__mep_using run' -l on-loss -x -a 'term kill ignore' -d 'What to do when the lease is lost'
complete -c mep -n '__mep_using run' -l sync-on-exit -d 'Sync the memory to the data plane before the release'
complete -c mep -n '__mep_using run' -l grace -x -d 'Seconds between SIGTERM and SIGKILL'
complete -c mep -n '__mep_using run' -l label -x -d 'KEY=VALUE shown to operators (repeat, at most 16)'
complete -c mep -n '__mep_using run' -l max-hold -x -d 'Longest the lease may be held, in seconds'
complete -c mep -n '__mep_using run' -F

# mcp: options only (the MCP client talks on stdin and stdout).
complete -c mep -n '__mep_using mcp' -l name -x -d "The agent's name"
complete -c mep -n '__mep_using mcp' -l memory -r -F -d 'The .uai memory file (created empty when missing)'
complete -c mep -n '__mep_using mcp' -l ttl -x -d 'Lease TTL in seconds (5-300)'
complete -c mep -n '__mep_using mcp' -l if-held -x -a 'read-only fail' -d 'When another agent holds the memory'
complete -c mep -n '__mep_using mcp' -l label -x -d 'KEY=VALUE shown to operators (repeat, at most 16)'
complete -c mep -n '__mep_using mcp' -l max-hold -x -d 'Longest the lease may be held, in seconds'

complete -c mep -n '__mep_using release' -x -a '(__mep_held_names)'
complete -c mep -n '__mep_arg 1 sync' -x -a '(__mep_held_names)'
# fetch: ID (free-form), then the new PATH (a file).
complete -c mep -n '__mep_arg 2 fetch' -F
complete -c mep -n '__mep_using init' -F
complete -c mep -n '__mep_using branch' -F
complete -c mep -n '__mep_using identify' -F
complete -c mep -n '__mep_using lineage' -F
complete -c mep -n '__mep_using lineage' -l format -x -a 'tree dot json' -d 'Output format'

complete -c mep -n '__mep_using canonicalize' -l explain -d 'Show the string after each step'
complete -c mep -n '__mep_using canonicalize' -l profile -x -a 'agent usernamecasemapped' -d 'Canonicalization profile'

# token create|list|revoke|new|hash
complete -c mep -n '__mep_needs_sub token' -a create -d 'Create a token and print it once'
complete -c mep -n '__mep_needs_sub token' -a list -d 'List tokens'
complete -c mep -n '__mep_needs_sub token' -a revoke -d 'Revoke a token by its id'
complete -c mep -n '__mep_needs_sub token' -a new -d 'Print a new random token (for mep store)'
complete -c mep -n '__mep_needs_sub token' -a hash -d 'Print the SHA-256 of a token (or of each stdin line)'
complete -c mep -n '__mep_using token create; or __mep_using token list; or __mep_using token revoke' -l db -x -d 'Database URL (sqlite:PATH or postgresql://...)'
complete -c mep -n '__mep_using token create; or __mep_using token list' -l tenant -x -d 'Tenant name'
complete -c mep -n '__mep_using token create' -l scope -x -a 'lease admin' -d 'Token scope'
complete -c mep -n '__mep_using token create' -l admin -d 'Same as --scope admin'

# store
complete -c mep -n '__mep_using store' -l listen -x -d 'HOST:PORT to listen on'
complete -c mep -n '__mep_using store' -l dir -x -a '(__fish_complete_directories)' -d 'Data directory'
complete -c mep -n '__mep_using store' -l token-file -r -F -d 'SHA-256 of each accepted token, one per line'
complete -c mep -n '__mep_using store' -l strict -d 'Check every request with the control plane'
complete -c mep -n '__mep_using store' -l control-plane -x -d 'URL of the mep server --strict asks'
complete -c mep -n '__mep_using store' -l ca-file -r -F -d 'PEM certificates to trust for --control-plane'
complete -c mep -n '__mep_using store' -l max-object-size -x -d 'Largest object (bytes, 64MiB, 1GiB)'
complete -c mep -n '__mep_using store' -l tls-cert -r -F -d 'PEM certificate chain'
complete -c mep -n '__mep_using store' -l tls-key -r -F -d 'PEM private key'
complete -c mep -n '__mep_using store' -l insecure-plaintext -d 'Allow plain HTTP beyond loopback'
complete -c mep -n '__mep_using store' -l log-level -x -a 'debug info warn error' -d 'Log level'
complete -c mep -n '__mep_using store' -l threads -x -d 'I/O threads (1-64)'

# server [audit]
complete -c mep -n '__mep_needs_sub server' -a audit -d 'List the newest audit rows'
complete -c mep -n '__mep_using server' -l db -x -d 'Database URL (sqlite:PATH or postgresql://...)'
complete -c mep -n '__mep_needs_sub server' -l listen -x -d 'HOST:PORT to listen on'
complete -c mep -n '__mep_needs_sub server' -l tls-cert -r -F -d 'PEM certificate chain'
complete -c mep -n '__mep_needs_sub server' -l tls-key -r -F -d 'PEM private key'
complete -c mep -n '__mep_needs_sub server' -l insecure-plaintext -d 'Allow plain HTTP beyond loopback'
complete -c mep -n '__mep_needs_sub server' -l rate-limit -x -d 'Requests per second per token'
complete -c mep -n '__mep_needs_sub server' -l log-level -x -a 'debug info warn error' -d 'Log level'
complete -c mep -n '__mep_needs_sub server' -l threads -x -d 'I/O threads (1-64)'
complete -c mep -n '__mep_needs_sub server' -l writer-nice -x -d 'Nice value of the SQLite commit thread (-20-19)'
complete -c mep -n '__mep_needs_sub server' -l isolation -x -a 'read-committed serializable' -d 'PostgreSQL transaction isolation'
complete -c mep -n '__mep_needs_sub server' -l db-pool -x -d 'PostgreSQL connections for lease operations'
complete -c mep -n '__mep_needs_sub server' -l max-hold -x -d 'Longest any lease may be held, in seconds'
complete -c mep -n '__mep_using server audit' -l tenant -x -d 'Only this tenant'
complete -c mep -n '__mep_using server audit' -l limit -x -d 'At most this many rows'

# migrate plan|run|activate|status
complete -c mep -n '__mep_needs_sub migrate' -a plan -d 'Dry run: print the report, write nothing'
complete -c mep -n '__mep_needs_sub migrate' -a run -d 'Migrate (resumable and idempotent)'
complete -c mep -n '__mep_needs_sub migrate' -a activate -d 'Open the lease endpoints'
complete -c mep -n '__mep_needs_sub migrate' -a status -d 'Counts and the enforcement flag'
complete -c mep -n '__mep_using migrate' -l db -x -d 'Database URL (sqlite:PATH or postgresql://...)'
complete -c mep -n '__mep_using migrate plan; or __mep_using migrate run' -l input -r -F -d 'Legacy rows, JSON Lines or CSV'
complete -c mep -n '__mep_using migrate plan; or __mep_using migrate run' -l from-table -x -d 'Read the legacy rows from this table'
complete -c mep -n '__mep_using migrate plan; or __mep_using migrate run' -l report -r -F -d 'Write one JSON line per legacy row'
complete -c mep -n '__mep_using migrate plan; or __mep_using migrate run' -l tenant -x -d 'Tenant that owns the memories'
complete -c mep -n '__mep_using migrate run' -l batch -x -d 'Rows per transaction'

# lease ls|show|revoke|history (the control plane, with a token)
complete -c mep -n '__mep_needs_sub lease' -a ls -d "List the tenant's live leases and their holders"
complete -c mep -n '__mep_needs_sub lease' -a show -d 'Show one lease in full'
complete -c mep -n '__mep_needs_sub lease' -a revoke -d 'End the live lease on NAME now (admin scope)'
complete -c mep -n '__mep_needs_sub lease' -a history -d "A name's grants, expiries and revocations (admin scope)"
set -l __mep_lease_subs '__mep_using lease ls; or __mep_using lease show; or __mep_using lease revoke; or __mep_using lease history'
complete -c mep -n $__mep_lease_subs -l server -x -d 'URL of the control plane'
complete -c mep -n $__mep_lease_subs -l token-file -r -F -d 'File holding a token of the tenant'
complete -c mep -n $__mep_lease_subs -l ca-file -r -F -d 'PEM certificates to trust for an https:// server'
complete -c mep -n '__mep_using lease ls' -l name -x -d 'Only names matching this glob'
complete -c mep -n '__mep_using lease ls' -l host -x -a '(__fish_print_hostnames)' -d 'Only leases held from this host'
complete -c mep -n '__mep_using lease ls' -l label -x -d 'Only leases with this label (KEY=VALUE or KEY)'
complete -c mep -n '__mep_using lease ls' -l expiring-within -x -d 'Only leases that expire within this many seconds'
complete -c mep -n '__mep_using lease revoke' -l reason -x -d 'Why, told to the holder'
complete -c mep -n '__mep_using lease history' -l since -x -d 'Only events from this time (RFC 3339, or 90s, 15m, 2h, 7d)'
complete -c mep -n '__mep_using lease history' -l limit -x -d 'At most this many events'
