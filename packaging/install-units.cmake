# Installs the systemd units with @MEP_BINDIR@ set to the installed binaries' directory.
# Runs inside `cmake --install` / cpack (see CMakeLists.txt), where CMAKE_INSTALL_PREFIX is
# the real prefix and file(INSTALL) adds DESTDIR and records the files in the manifest.
set(MEP_BINDIR "${CMAKE_INSTALL_PREFIX}/${MEP_INSTALL_BINDIR}")
foreach(mode system user)
  file(GLOB units "${MEP_UNITS_SOURCE_DIR}/${mode}/*.service" "${MEP_UNITS_SOURCE_DIR}/${mode}/*.socket")
  set(configured)
  foreach(unit IN LISTS units)
    get_filename_component(name "${unit}" NAME)
    configure_file("${unit}" "${MEP_UNITS_BINARY_DIR}/${mode}/${name}" @ONLY)
    list(APPEND configured "${MEP_UNITS_BINARY_DIR}/${mode}/${name}")
  endforeach()
  file(INSTALL DESTINATION "${CMAKE_INSTALL_PREFIX}/lib/systemd/${mode}" TYPE FILE
       PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ FILES ${configured})
endforeach()
