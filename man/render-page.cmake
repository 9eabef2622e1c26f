# Renders one scdoc page at build time: cmake -DSCDOC=... -DINPUT=x.scd -DOUTPUT=x.1
# -DVERSION=... [-DGZIP=...] -P render-page.cmake. Writes OUTPUT and, with GZIP,
# OUTPUT.gz (gzip -9n: no name or time stamp, as Debian policy asks).
#
# scdoc opens every block with a `.P`, also right after a section heading and right
# before the next one; mandoc -Tlint warns about each ("skipping paragraph macro").
# Those empty paragraphs are removed here so the pages lint clean; nothing else changes.
cmake_minimum_required(VERSION 3.25)
foreach(var SCDOC INPUT OUTPUT VERSION)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "render-page.cmake: -D${var}=... is required")
  endif()
endforeach()

file(READ "${INPUT}" source)
string(REPLACE "@VERSION@" "${VERSION}" source "${source}")
get_filename_component(name "${OUTPUT}" NAME)
set(expanded "${OUTPUT}.scd")
file(WRITE "${expanded}" "${source}")

execute_process(COMMAND "${SCDOC}" INPUT_FILE "${expanded}" OUTPUT_VARIABLE roff
                ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "scdoc failed on ${INPUT}: ${err}")
endif()

# A .P that ends an indented block moves after its .RE (it is the blank line between two
# definitions); then a .P directly after .TH/.SH/.SS, or directly before .SH/.SS or another
# .P, goes. Matches overlap, so repeat until nothing changes.
set(previous "")
while(NOT roff STREQUAL previous)
  set(previous "${roff}")
  string(REGEX REPLACE "\n\\.P\n\\.RE\n" "\n.RE\n.P\n" roff "${roff}")
  string(REGEX REPLACE "\n(\\.(TH|SH|SS)[^\n]*)\n\\.P\n" "\n\\1\n" roff "${roff}")
  string(REGEX REPLACE "\n\\.P\n(\\.(SH|SS|P)[ \n])" "\n\\1" roff "${roff}")
endwhile()
string(REGEX REPLACE "\n\\.P\n?$" "\n" roff "${roff}")
file(WRITE "${OUTPUT}" "${roff}")

if(GZIP)
  execute_process(COMMAND "${GZIP}" -9 -n -c "${OUTPUT}" OUTPUT_FILE "${OUTPUT}.gz" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "gzip failed on ${OUTPUT}")
  endif()
endif()
file(REMOVE "${expanded}")
