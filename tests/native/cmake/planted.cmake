# planted(name source from to): writes `name`.cc in the build folder, `source`
# with `from` replaced by `to` (exactly once): a build of the same code with one
# planted bug, for tests that show their checks catch what they are for. Fails
# the configure step when `from` no longer occurs in `source`.
function(planted name source from to)
  file(READ "${source}" text)
  string(FIND "${text}" "${from}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "the planted bug '${name}' no longer applies to ${source}: update it")
  endif()
  string(REPLACE "${from}" "${to}" text "${text}")
  file(WRITE "${CMAKE_BINARY_DIR}/${name}.cc" "${text}")
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${source}")
endfunction()
