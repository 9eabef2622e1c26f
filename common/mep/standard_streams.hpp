// Standard input, output and error a process was started without.
#pragma once

namespace mep {

/// Opens /dev/null as each of descriptors 0, 1 and 2 that is closed. Called first thing in
/// main(): otherwise the next descriptor opened (a socket, a lock, mep run's guard) would
/// become one of them, and a log line or message meant for stderr would be written into it.
/// False when /dev/null cannot be opened in a closed one's place (nothing can be said then).
bool open_standard_streams();

} // namespace mep
