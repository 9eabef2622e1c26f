# fish completion for mepd(8). Installed in share/fish/vendor_completions.d.
complete -c mepd -f
complete -c mepd -s h -l help -d 'Print help and exit'
complete -c mepd -l version -d 'Print the version and exit'
complete -c mepd -l system -d 'One daemon for a shared host (the group mep)'
complete -c mepd -l socket -r -F -d 'Socket path'
complete -c mepd -l state-dir -x -a '(__fish_complete_directories)' -d 'State directory'
complete -c mepd -l control-plane -x -d 'URL of a mep server; none: embedded control plane'
complete -c mepd -l token-file -r -F -d 'File holding the bearer token'
complete -c mepd -l store -x -d 'URL of a data plane (mep store)'
complete -c mepd -l store-token-file -r -F -d 'File holding the bearer token for --store'
complete -c mepd -l ca-file -r -F -d 'PEM certificates to trust for https:// planes'
complete -c mepd -l config -r -F -d 'Config file'
complete -c mepd -l log-level -x -a 'debug info warn error' -d 'Log level'
