# bash completion for mep(1) and mepd(8). Self-contained (plain compgen, no helpers from
# the bash-completion package), so `source completions/mep.bash` is enough.
# Installed as share/bash-completion/completions/mep and .../mepd.

# Options of mep that take a value (the value is the next word, or follows '=').
_mep_valued=" --socket --config --ttl --wait --on-loss --grace --format --profile --db --listen
 --tls-cert --tls-key --rate-limit --log-level --threads --tenant --limit --scope --input
 --from-table --report --batch --isolation --db-pool --writer-nice --dir --token-file
 --control-plane --max-object-size --ca-file --label --max-hold --name --host
 --expiring-within --server --since --reason --memory --if-held "
_mep_valued=${_mep_valued//$'\n'/ } # each name between spaces, also at the ends of lines

# Completes the value of option $1 (the previous word), with $2 the current word.
# Returns 1 when $1 takes no value.
_mep_option_value() {
    case $1 in
        --socket | --config | --tls-cert | --tls-key | --input | --report | --token-file | --store-token-file | --ca-file)
            compgen -f -- "$2" ;;
        --state-dir | --dir)
            compgen -d -- "$2" ;;
        --on-loss)   compgen -W "term kill ignore" -- "$2" ;;
        --if-held)   compgen -W "read-only fail" -- "$2" ;;
        --memory)    compgen -f -- "$2" ;;
        --format)    compgen -W "tree dot json" -- "$2" ;;
        --profile)   compgen -W "agent usernamecasemapped" -- "$2" ;;
        --log-level) compgen -W "debug info warn error" -- "$2" ;;
        --scope)     compgen -W "lease admin" -- "$2" ;;
        --isolation) compgen -W "read-committed serializable" -- "$2" ;;
        --host)      compgen -A hostname -- "$2" ;;
        --ttl | --wait | --grace | --db | --listen | --rate-limit | --threads | --tenant | --limit | \
        --from-table | --batch | --control-plane | --db-pool | --writer-nice | --max-object-size | --store | \
        --label | --max-hold | --name | --expiring-within | --server | --since | --reason)
            ;; # free-form: nothing to offer
        *) return 1 ;;
    esac
    return 0
}

# Fills COMPREPLY with the values of the option being completed, if the cursor is on one:
# `--opt VALUE`, `--opt=VALUE` in one word, or `--opt = VALUE` (bash splits words at '=').
# $1 lists the options that take a value. Returns 1 when the cursor is not on a value.
_mep_complete_value() {
    local cur=${COMP_WORDS[COMP_CWORD]} opt="" val=""
    if [[ $cur == --*=* ]]; then
        opt=${cur%%=*} val=${cur#*=}
    elif [[ $cur == = ]] && ((COMP_CWORD > 0)); then
        opt=${COMP_WORDS[COMP_CWORD - 1]}
    elif ((COMP_CWORD > 1)) && [[ ${COMP_WORDS[COMP_CWORD - 1]} == = ]]; then
        opt=${COMP_WORDS[COMP_CWORD - 2]} val=$cur
    elif ((COMP_CWORD > 0)); then
        opt=${COMP_WORDS[COMP_CWORD - 1]} val=$cur
    fi
    [[ $opt == -* && $1 == *" $opt "* ]] || return 1
    mapfile -t COMPREPLY < <(_mep_option_value "$opt" "$val")
    return 0
}

_mep() {
    local cur=${COMP_WORDS[COMP_CWORD]}
    local globals="--help -h --version --json -v --verbose --socket --config"
    local commands="canonicalize server store token claim release init branch status identify lineage sync fetch config run migrate lease mcp"
    COMPREPLY=()

    # Find the command, its subcommand and the number of positionals before the cursor.
    local cmd="" sub="" npos=0 dashdash=-1 i w
    for ((i = 1; i < COMP_CWORD; i++)); do
        w=${COMP_WORDS[i]}
        if [[ $w == -- && $cmd == run ]]; then
            dashdash=$i
            break
        fi
        if [[ $w == -* ]]; then
            # Skip the option's value: `--opt value`, or `--opt = value` as bash splits `--opt=value`.
            if [[ $w != *=* && $_mep_valued == *" $w "* ]]; then
                ((i++))
                [[ ${COMP_WORDS[i]} == = ]] && ((i++))
                # bash splits a value at '=' and ':' too: `--label team=infra` arrives as
                # team, =, infra; `--db sqlite:/x` as sqlite, :, /x. The pieces are the value's.
                while ((i + 1 < COMP_CWORD)) && [[ ${COMP_WORDS[i + 1]} == [=:] ]]; do
                    ((i += 2))
                done
            fi
            continue
        fi
        if [[ -z $cmd ]]; then
            cmd=$w
        elif [[ -z $sub && ($cmd == token || $cmd == server || $cmd == migrate || $cmd == lease) ]]; then
            sub=$w
        else
            ((npos++))
        fi
    done

    # After `mep run NAME PATH --`: a command, then its arguments (files).
    if ((dashdash > 0)); then
        if ((COMP_CWORD == dashdash + 1)); then
            mapfile -t COMPREPLY < <(compgen -c -- "$cur" | awk '!seen[$0]++')
        else
            mapfile -t COMPREPLY < <(compgen -f -- "$cur")
        fi
        return 0
    fi

    # The value of the option before the cursor.
    if _mep_complete_value "$_mep_valued"; then
        return 0
    fi

    # The options of the command (global options are accepted everywhere).
    local opts=""
    case $cmd/$sub in
        canonicalize/*) opts="--json --explain --profile" ;;
        claim/*)        opts="--ttl --wait --label --max-hold" ;;
        run/*)          opts="--ttl --wait --on-loss --grace --label --max-hold --sync-on-exit" ;;
        mcp/*)          opts="--name --memory --ttl --if-held --label --max-hold" ;;
        lineage/*)      opts="--format" ;;
        server/)        opts="--db --listen --tls-cert --tls-key --insecure-plaintext --rate-limit --log-level --threads --writer-nice --isolation --db-pool --max-hold" ;;
        server/audit)   opts="--db --tenant --limit --json" ;;
        store/*)        opts="--listen --dir --token-file --strict --control-plane --ca-file --max-object-size --tls-cert --tls-key --insecure-plaintext --log-level --threads" ;;
        token/create)   opts="--db --tenant --scope --admin --json" ;;
        token/list)     opts="--db --tenant --json" ;;
        token/revoke)   opts="--db" ;;
        migrate/plan)   opts="--db --input --from-table --report --tenant" ;;
        migrate/run)    opts="--db --input --from-table --report --tenant --batch" ;;
        migrate/activate | migrate/status) opts="--db" ;;
        lease/ls)       opts="--name --host --label --expiring-within --server --token-file --ca-file --json" ;;
        lease/show)     opts="--server --token-file --ca-file --json" ;;
        lease/revoke)   opts="--reason --server --token-file --ca-file --json" ;;
        lease/history)  opts="--since --limit --server --token-file --ca-file --json" ;;
    esac
    if [[ $cur == -* ]]; then
        mapfile -t COMPREPLY < <(compgen -W "$opts $globals" -- "$cur" | awk '!seen[$0]++')
        return 0
    fi

    # Commands, subcommands and positionals.
    case $cmd in
        "")      mapfile -t COMPREPLY < <(compgen -W "$commands" -- "$cur") ;;
        token)   [[ -z $sub ]] && mapfile -t COMPREPLY < <(compgen -W "create list revoke new hash" -- "$cur") ;;
        server)  [[ -z $sub ]] && mapfile -t COMPREPLY < <(compgen -W "audit" -- "$cur") ;;
        migrate) [[ -z $sub ]] && mapfile -t COMPREPLY < <(compgen -W "plan run activate status" -- "$cur") ;;
        lease)   [[ -z $sub ]] && mapfile -t COMPREPLY < <(compgen -W "ls show revoke history" -- "$cur") ;;
        claim | run)
            # NAME (free-form), then PATH; `mep run NAME PATH` continues with --.
            if ((npos == 1)); then
                mapfile -t COMPREPLY < <(compgen -f -- "$cur")
            elif [[ $cmd == run ]] && ((npos == 2)); then
                COMPREPLY=(--)
            fi
            ;;
        release | sync)
            # The names mepd holds (quietly nothing when it is not running).
            ((npos == 0)) && mapfile -t COMPREPLY < <(compgen -W \
                "$(command mep status 2>/dev/null | awk 'NR > 1 { print $1 }')" -- "$cur")
            ;;
        init | identify | lineage)
            ((npos == 0)) && mapfile -t COMPREPLY < <(compgen -f -- "$cur") ;;
        branch)
            ((npos < 2)) && mapfile -t COMPREPLY < <(compgen -f -- "$cur") ;;
        fetch)
            # ID (free-form), then the new PATH.
            ((npos == 1)) && mapfile -t COMPREPLY < <(compgen -f -- "$cur") ;;
    esac
    return 0
}

_mepd() {
    local cur=${COMP_WORDS[COMP_CWORD]}
    COMPREPLY=()
    if _mep_complete_value " --socket --state-dir --control-plane --token-file --store --store-token-file --ca-file --config --log-level "; then
        return 0
    fi
    mapfile -t COMPREPLY < <(compgen -W "--help -h --system --socket --state-dir --control-plane --token-file
        --store --store-token-file --ca-file --anonymous-holder --config --log-level --version" -- "$cur")
    return 0
}

complete -o filenames -F _mep mep
complete -o filenames -F _mepd mepd
